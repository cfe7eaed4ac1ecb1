"""tokens/s and MFU of a finished run, from its metrics.jsonl and config.toml.

    python bench/mfu_from_metrics.py RUN_DIR [--skip N] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from threefold.config import load_config
from threefold.models.decoder import count_parameters
from threefold.train.metrics import read_metrics

from gpu_throughput import device_peak  # the dense bf16 peaks, beside this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out (warm-up)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of one device (default: by device name)")
    args = parser.parse_args()
    cfg = load_config(args.run / "config.toml") if (args.run / "config.toml").exists() else None
    rows = read_metrics(args.run / "metrics.jsonl")[args.skip:]
    tokens_per_s = sum(r["tokens"] for r in rows) / sum(r["step_time_s"] for r in rows)
    print(f"steps={len(rows)} tokens_per_s={tokens_per_s:,.0f}")
    if cfg is None:
        return
    m = cfg.model
    flops_per_token = 6 * count_parameters(m) + 12 * m.layers * m.hidden * cfg.train.seq_len
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    if peak is None and torch.cuda.is_available():
        peak = device_peak(torch.device("cuda"))
    achieved = flops_per_token * tokens_per_s
    print(f"achieved_tflops={achieved / 1e12:.1f}" + (f" MFU={achieved / peak:.3f}" if peak else ""))


if __name__ == "__main__":
    main()
