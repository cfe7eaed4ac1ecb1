"""The checks of the debug and fault sections (fault.layout is read by layout.py `Layout.parse`)."""

from __future__ import annotations

from .sections import FaultConfig, Sections
from ..errors import ConfigError
from ..layout import Layout


def fault_applies(fault: FaultConfig, layout: Layout) -> bool:
    """Whether the injected fault is meant for a run of `layout`: fault.layout ("dp,tp,pp" or
    "dp,tp,pp,cp", cp 1 when not written) names the mesh's axes, so it matches on their sizes (ep,
    a cut of dp, is not one)."""
    return fault.rank >= 0 and (not fault.layout or Layout.parse(fault.layout, "fault.layout").shape == layout.shape)


def validate_debug(c: Sections) -> None:
    d, f = c.debug, c.fault
    if d.history == 0:
        for key, on in [("debug.watchdog", d.watchdog), ("debug.fingerprint_every", d.fingerprint_every),
                        ("debug.stats", d.stats), ("debug.trace", d.trace)]:
            if on:
                raise ConfigError(key, "needs the flight recorder, which debug.history=0 turns off; "
                                  "keep debug.history > 0 or turn this off")
    if f.layout:
        Layout.parse(f.layout, "fault.layout")
    if f.kind == "nan" and not f.module:
        raise ConfigError("fault.module", "name the module whose output becomes NaN, e.g. blocks.0.mlp.up")
