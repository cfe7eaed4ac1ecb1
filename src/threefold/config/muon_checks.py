"""The checks of train.optimizer=muon (optim/muon.py): what its whole-matrix exchange
(optim/exchange.py) does not serve yet is refused in one line naming why. Muon runs under dp,
ZeRO 1-3, tp and pp (docs/zero.md "Muon")."""

from __future__ import annotations

from ..errors import ConfigError
from ..schedules.registry import SCHEDULES


def validate_muon(c) -> None:
    """`c`: the config's sections (config/sections.py `Sections`)."""
    m, p, t = c.model, c.parallel, c.train
    if t.optimizer != "muon":
        return
    refusals = (
        ("parallel.cp", p.cp > 1, "the matrix exchange runs over dp and tp, not cp; use parallel.cp=1"),
        ("model.experts", bool(m.experts), "expert weights are not assembled per expert yet; use a dense model"),
        ("model.lora_rank", m.lora_rank > 0, "LoRA adapters are not hidden matrices of the model; use adamw"),
        ("parallel.offload", p.offload != "none", "the optimizer states in host memory or files are not wired; "
                                                  "use parallel.offload=none"),
        ("compress.method", c.compress.method in ("dgc", "onebit", "powersgd"),
         "a lossy gradient exchange applies its own momentum or optimizer; use compress.method none/fp16/bf16"),
        ("train.sync_every", t.periodic, "replicas stepping alone (local SGD, DiLoCo, EASGD) are not wired; "
                                         "use train.sync_every=1 with no outer optimizer"),
        ("pipeline.schedule", p.pp > 1 and not SCHEDULES[c.pipeline.schedule].synchronous,
         "a schedule updating weights without a flush keeps its own optimizer step; choose a flushing schedule"),
    )
    for key, refused, why in refusals:
        if refused:
            raise ConfigError(key, f"train.optimizer=muon: {why}")
