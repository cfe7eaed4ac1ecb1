"""The layout of a run: how many ranks each mesh axis has, and how dp splits for expert parallelism.

One record, `Layout`, read by the config's checks, the Mesh (mesh.py builds its process groups
from it), fault injection (`fault.layout`), checkpoint metadata (the manifest's `layout`) and the
planner (whose `Strategy`, planner/workload.py, is a Layout with the knobs it searches). Plain
Python: the config and the planner import it without torch.

`AXES` is the mesh's axes, outermost first (mesh.py gives each its roles); the global rank is
their mixed-radix coordinate, tp fastest. `ep` is not an axis of the world: it cuts dp into runs
of ep ranks (mesh.py `ep` / `edp`). A layout has three written forms, each made and read here:

    str(layout)          "dp=4 tp=2 pp=1 ep=2 cp=2" (ep and cp named when > 1): messages, plan labels
    layout.text          "dp,tp,pp" or "dp,tp,pp,cp" (cp when > 1): fault.layout, `threefold parity
                         --layouts`; `Layout.parse` reads it back
    layout.fields()      {"dp", "tp", "pp"} + "ep" / "cp" when > 1: the checkpoint manifest's
                         layout (with zero and world_size, checkpoint/format.py); `Layout.from_fields`
                         reads any manifest's back, old ones included (a missing axis is 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .errors import ConfigError

AXES = ("pp", "dp", "cp", "tp")  # the mesh's axes, outermost first (mesh.py MESH_AXES: their roles)
SIZES = ("dp", "tp", "pp", "ep", "cp")  # the record's fields, in its order


class Sizes(Protocol):
    """Anything naming the five sizes: the config's parallel section (config/sections.py
    ParallelConfig), a Layout, a planner Strategy."""

    dp: int
    tp: int
    pp: int
    ep: int
    cp: int


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism: a factor of dp
    cp: int = 1  # context parallelism: each sequence split over cp ranks

    @classmethod
    def of(cls, sizes: Sizes, world_size: int = 0, **rest) -> Layout:
        """The layout of `sizes` (the parallel section); its dp of 0 ("auto") becomes what cp x tp x pp
        leave of `world_size`. `rest`: the other fields of a subclass (a planner Strategy's knobs)."""
        dp = sizes.dp or (world_size // (sizes.cp * sizes.tp * sizes.pp) if world_size else 0)
        return cls(dp=dp, tp=sizes.tp, pp=sizes.pp, ep=sizes.ep, cp=sizes.cp, **rest)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes of AXES, in their order (the mesh's shape)."""
        return tuple(getattr(self, axis) for axis in AXES)

    @property
    def replicas(self) -> int:
        """The ranks one gradient is reduced over and ZeRO shards over: dp and cp together (mesh.py
        `replica_axis`, one collective over dp+cp); dp alone at cp = 1."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """The dp ranks holding the same experts (dp / ep)."""
        return self.dp // self.ep

    @property
    def expert_replicas(self) -> int:
        """The ranks one routed expert's gradient is reduced and ZeRO-sharded over: edp, and under context
        parallelism edp x cp in one collective (mesh.py `expert_replica_axis`, docs/context.md)."""
        return self.edp * self.cp

    def __str__(self) -> str:
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}" + (f" ep={self.ep}" if self.ep > 1 else "")
                + (f" cp={self.cp}" if self.cp > 1 else ""))

    @property
    def text(self) -> str:
        """"dp,tp,pp", or "dp,tp,pp,cp" when cp > 1: the form `parse` reads."""
        return f"{self.dp},{self.tp},{self.pp}" + (f",{self.cp}" if self.cp > 1 else "")

    @classmethod
    def parse(cls, text: str, key: str, cp: bool = True) -> Layout:
        """ "dp,tp,pp" (or, with `cp`, "dp,tp,pp,cp") -> the Layout, each size at least 1; a bad text
        is a ConfigError naming `key`."""
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) not in ((3, 4) if cp else (3,)) or min(values) < 1:
            forms = "dp,tp,pp or dp,tp,pp,cp" if cp else "dp,tp,pp"
            raise ConfigError(key, f"'{text}' is not a layout; write {forms} with positive integers, e.g. 2,1,1"
                              + (" or 1,1,1,2" if cp else ""))
        return cls(*values[:3], cp=values[3] if len(values) == 4 else 1)

    def fields(self) -> dict[str, int]:
        """The checkpoint manifest's sizes: dp, tp, pp, and ep and cp when > 1 (a layout without them
        writes what it always wrote)."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, **({"ep": self.ep} if self.ep > 1 else {}),
                **({"cp": self.cp} if self.cp > 1 else {})}

    @classmethod
    def from_fields(cls, fields: dict) -> Layout:
        """The layout a manifest's `layout` names; a size it does not name is 1."""
        return cls(**{name: int(fields.get(name, 1)) for name in SIZES})
