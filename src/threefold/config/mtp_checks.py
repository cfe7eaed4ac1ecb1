"""The checks of multi-token prediction (`model.mtp_depth`, models/mtp.py) against the other keys.

Part of `Config.validate` (checks.py calls `validate_mtp`), as moe_checks.py is for the experts.
Each refusal names the key, why, and the fix.
"""

from __future__ import annotations

from .sections import Sections
from ..schedules.registry import SCHEDULES
from ..errors import ConfigError


def validate_mtp(c: Sections) -> None:
    m, p, t = c.model, c.parallel, c.train
    if not m.mtp_depth:
        if m.mtp_weight != type(m)().mtp_weight:
            raise ConfigError("model.mtp_weight", f"{m.mtp_weight} weighs the multi-token prediction loss, which "
                              "model.mtp_depth=0 turns off; set model.mtp_depth > 0, or drop model.mtp_weight")
        return
    for prefix, what in (("hf:", "a Hugging Face model (hf:DIR): its format has no place for the extra depths"),
                         ("py:", "a user's own module (py:MODULE:FACTORY)")):
        if m.preset.startswith(prefix):
            raise ConfigError("model.mtp_depth", f"multi-token prediction is built into threefold's own decoder, "
                              f"not {what}; set model.mtp_depth=0")
    if p.pp > 1 and not SCHEDULES[c.pipeline.schedule].synchronous:
        raise ConfigError("model.mtp_depth", f"multi-token prediction does not run under {c.pipeline.schedule}: the "
                          "depths on the last stage share the embedding with the first, whose gradients must meet "
                          "between the two stages (a flush) as a tied weight's do; use a synchronous pipeline.schedule "
                          "or mtp_depth=0")
    if p.cp > 1:
        raise ConfigError("model.mtp_depth", f"multi-token prediction does not run under context parallelism "
                          f"(cp={p.cp}): depth k embeds and predicts tokens k positions along the sequence, which "
                          "the zigzag split holds on other cp ranks; use parallel.cp=1 or mtp_depth=0")
    if p.tp > 1 and p.sequence_parallel:
        raise ConfigError("model.mtp_depth", "multi-token prediction does not run with parallel.sequence_parallel: "
                          "each tp rank holds part of the sequence, so the depths cannot leave out the last k positions "
                          "of a row, and the vocabulary-parallel loss counts ignored targets; use "
                          "parallel.sequence_parallel=false or mtp_depth=0")
    if m.mtp_depth >= t.seq_len:
        raise ConfigError("model.mtp_depth", f"{m.mtp_depth} depths leave no target in a row of train.seq_len="
                          f"{t.seq_len} tokens (depth k predicts k + 1 ahead); use mtp_depth < seq_len")
