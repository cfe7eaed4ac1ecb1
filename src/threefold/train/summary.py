"""The end of a run in three lines: the path its attention took, what it did (and where its wall time
went: goodput, observe/goodput.py), and where its files are.

Read from DIR/metrics.jsonl (so a resumed run reports the whole run, not only its last
attempt), DIR/config.toml (the resolved config: the attention path, models/attention.py
`attention_path`) and the run directory; printed by the writing rank, also with `--no-progress`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..observe.goodput import read_lines, run_breakdown, summary_line

PLOTS = ("loss.png", "throughput.png", "memory.png", "ranks.png", "pipeline.png")
VALIDATION_KEYS = ("val_loss", "validation_loss", "eval_loss")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def results_line(records: list[dict]) -> str:
    """Steps, final and best loss (validation loss when logged), tokens/s, peak memory, bytes per step by axis."""
    if not records:
        return "done: no step ran"
    losses = [(r["loss"], r["step"]) for r in records if isinstance(r.get("loss"), (int, float))]
    parts = [f"done: {records[-1]['step']} steps"]
    if losses:
        best, best_step = min(losses)
        parts.append(f"loss {losses[0][0]:.4f} -> {losses[-1][0]:.4f} (best {best:.4f} at step {best_step})")
    for key in VALIDATION_KEYS:
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        if values:
            parts.append(f"validation loss {values[-1]:.4f} (best {min(values):.4f})")
            break
    time_s = sum(r.get("step_time_s", 0.0) for r in records)
    if time_s > 0:
        parts.append(f"{sum(r.get('tokens', 0) for r in records) / time_s:,.0f} tokens/s")
    peaks = [r["mem"]["peak"] for r in records if isinstance(r.get("mem"), dict) and "peak" in r["mem"]]
    if peaks:
        parts.append(f"peak memory {human_bytes(max(peaks))} (rank 0)")
    sent: dict[str, float] = {}
    for r in records:
        for axis, ops in (r.get("comm") or {}).items():
            sent[axis] = sent.get(axis, 0) + sum(v for v in ops.values() if isinstance(v, (int, float)))
    if sent:
        parts.append("sent per step " + ", ".join(f"{axis} {human_bytes(total / len(records))}"
                                                  for axis, total in sorted(sent.items())))
    return ", ".join(parts)


def files_line(out: Path) -> str:
    """The paths of metrics, plots, checkpoints and logs of the run in `out`."""
    found = [name for name in ("metrics.jsonl", *PLOTS) if (out / name).exists()]
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step-*") if p.is_dir())
    if checkpoints:
        found.append(f"checkpoints/{checkpoints[-1]} ({len(checkpoints)} kept)")
    if (out / "logs").is_dir():
        found.append("logs/rank-N.log")
    return f"files in {out}: " + ", ".join(found)


def attention_line(out: Path) -> str | None:
    """The attention path of the run in `out` (its config.toml), from the device, the layout and the
    model's features: None when the config is not there or no longer loads."""
    from ..config.families import sliding_window
    from ..config.hf import read_config_json
    from ..config.load import load_config
    from ..errors import UserError
    from ..mesh import pick_device
    from ..models.attention import attention_path

    try:
        cfg = load_config(out / "config.toml")
        raw = read_config_json(Path(cfg.model.preset[3:])) if cfg.model.preset.startswith("hf:") else {}
    except UserError:
        return None
    device = pick_device(cfg.run.device).type  # the trainer's own rule
    window = sliding_window(raw) if raw else None
    return attention_path(device, cp_method=cfg.parallel.cp_method if cfg.parallel.cp > 1 else None,
                          packed=cfg.data.pack, window=window is not None and window < cfg.train.seq_len)


def print_summary(out: Path, file=None) -> None:
    file = file or sys.stderr
    records = read_lines(out / "metrics.jsonl")
    attention = attention_line(out)
    if attention is not None:
        print(f"threefold: {attention}", file=file, flush=True)
    goodput = summary_line(run_breakdown(out))  # where the wall time went, over every attempt (observe/goodput.py)
    done = results_line(records) + ("" if goodput is None else f"; {goodput}")
    print(f"threefold: {done}", file=file, flush=True)
    print(f"threefold: {files_line(out)}", file=file, flush=True)
