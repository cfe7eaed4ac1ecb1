"""Child process of tests/unit/test_nvme_memory.py: train under a cap on private writable memory.

`python -m tests.nvme_memory OUT BUDGET_MB OVERRIDES...`: after importing torch and threefold
(the interpreter's baseline), RLIMIT_DATA is set to the data segment then plus BUDGET_MB (0: no
cap) and the peak resident set is reset; prints one JSON line: whether training finished, the
peak resident bytes above the baseline, the optimizer's state bytes."""

from __future__ import annotations

import json
import resource
import sys


def status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    out, budget_mb, overrides = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    import torch
    import torch.distributed as dist

    from tests.helpers import make_config
    from threefold.train.trainer import Trainer

    torch.set_num_threads(1)
    # a world of one over an in-process store: no port to choose, none another process can take meanwhile
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = make_config(overrides, out)
    base_rss, base_data = status("VmRSS"), status("VmData")
    if budget_mb:
        resource.setrlimit(resource.RLIMIT_DATA, (status("VmData") + int(budget_mb * 2**20), resource.RLIM_INFINITY))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    report = {"base_rss": base_rss, "base_data": base_data}
    try:
        trainer = Trainer(cfg)
        trainer.run()
        report["done"] = True
        opt = trainer.optimizer
        report["states"] = getattr(opt, "nbytes", 0) or sum(t.numel() * 4 for t in opt.state_tensors())
    except (MemoryError, RuntimeError) as err:
        report["done"] = False
        report["error"] = str(err).splitlines()[0][:200]
    report["peak_above_base"] = status("VmHWM") - base_rss
    report["data_above_base"] = status("VmData") - base_data  # at the end: address space committed, touched or not
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
