"""The checks of the debug and fault sections, and the layout strings they and `threefold parity` read
("dp,tp,pp", fault.layout's optional cp)."""

from __future__ import annotations

from .sections import FaultConfig, Sections
from ..errors import ConfigError


def parse_layout(text: str, key: str) -> tuple[int, int, int]:
    """ "dp,tp,pp" -> (dp, tp, pp), each at least 1."""
    parts = text.split(",")
    try:
        values = tuple(int(v) for v in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 1:
        raise ConfigError(key, f"'{text}' is not a layout; write dp,tp,pp with positive integers, e.g. 2,1,1")
    return values


def parse_fault_layout(text: str) -> tuple[int, int, int, int]:
    """fault.layout "dp,tp,pp" or "dp,tp,pp,cp" -> (dp, tp, pp, cp), cp 1 when not written."""
    parts = text.split(",")
    if len(parts) == 4:
        *three, cp = parts
        dp, tp, pp = parse_layout(",".join(three), "fault.layout")
        if not cp.strip().isdigit() or int(cp) < 1:
            raise ConfigError("fault.layout", f"'{text}' is not a layout; write dp,tp,pp or dp,tp,pp,cp with "
                              "positive integers, e.g. 2,1,1 or 1,1,1,2")
        return dp, tp, pp, int(cp)
    return (*parse_layout(text, "fault.layout"), 1)


def fault_applies(fault: FaultConfig, layout: tuple[int, int, int, int]) -> bool:
    """Whether the injected fault is meant for a run of `layout` (dp, tp, pp, cp)."""
    return fault.rank >= 0 and (not fault.layout or parse_fault_layout(fault.layout) == tuple(layout))


def validate_debug(c: Sections) -> None:
    d, f = c.debug, c.fault
    if d.history == 0:
        for key, on in [("debug.watchdog", d.watchdog), ("debug.fingerprint_every", d.fingerprint_every),
                        ("debug.stats", d.stats), ("debug.trace", d.trace)]:
            if on:
                raise ConfigError(key, "needs the flight recorder, which debug.history=0 turns off; "
                                  "keep debug.history > 0 or turn this off")
    if f.layout:
        parse_fault_layout(f.layout)
    if f.kind == "nan" and not f.module:
        raise ConfigError("fault.module", "name the module whose output becomes NaN, e.g. blocks.0.mlp.up")
