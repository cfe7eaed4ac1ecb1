"""Child process of tests/unit/test_zero3_build.py: one rank of a world that builds a ZeRO-3 Trainer.

`python -m tests.zero3_build_memory OUT OVERRIDES...` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set: after importing torch and threefold (the interpreter's baseline) the peak resident
set is reset, the Trainer is built (no step) and one JSON line reports the peak resident bytes above
the baseline, those still resident once it is built (what the rank keeps: its shards, gradients,
masters and moments), the bytes of the whole model in fp32 and of its largest unit. Run it with
MALLOC_MMAP_THRESHOLD_ set low, so that glibc maps every large tensor on its own and unmaps it when
it is freed: the resident set then follows the tensors alive, not the allocator's caching."""

from __future__ import annotations

import json
import sys


def status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    out, overrides = sys.argv[1], sys.argv[2:]
    import torch
    import torch.distributed as dist

    from tests.helpers import make_config
    from threefold.models.registry import model_spec
    from threefold.train.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = make_config(overrides, out)
    with torch.device("meta"):
        whole = sum(p.numel() * 4 for p in model_spec(cfg.model, cfg.train.seed).build().parameters())
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    trainer = Trainer(cfg)
    print(json.dumps({"peak_above_base": status("VmHWM") - base, "kept_above_base": status("VmRSS") - base,
                      "whole_fp32": whole, "largest_unit_fp32": max(u.shard_flat.numel() * 4 * dist.get_world_size()
                                                                     for u in trainer.parallel.grad_sync.units)}),
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
