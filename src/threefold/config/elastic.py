"""Elastic jobs: the layout of a world smaller than the one the config was written for.

With `--nnodes MIN:MAX` the config's `parallel.dp` and `train.microbatches` describe the world
of MAX nodes (`parallel.elastic_world`). When the elastic agent restarts the job on fewer
nodes, every process re-derives the layout for the world it finds: tp, cp and pp stay, dp shrinks
to world / (cp x tp x pp), and the micro-batch size stays, so accumulation (micro-batches per dp
rank) grows by the factor dp shrank and the global batch is unchanged. The universal
checkpoint then loads under the new layout. Plain Python (no torch).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, TypeVar

from .sections import Sections
from ..errors import ConfigError

C = TypeVar("C", bound=Sections)  # the config that `check` (load.py's Config.validate) takes and returns


class NoLayout(ConfigError):
    """No layout fits the world left; `reason` says why."""

    def __init__(self, reason: str, message: str):
        super().__init__("parallel.elastic_world", message)
        self.reason = reason


def rederive(c: C, world: int, check: Callable[[C, int], C]) -> C:
    """`c` (written for `parallel.elastic_world`) for `world` processes, checked by `check`;
    ConfigError naming the smallest world that works when none fits `world`."""
    full = check(replace(c, parallel=replace(c.parallel, elastic_world=0)), c.parallel.elastic_world)
    try:
        return _layout_for(full, world, check)
    except ConfigError as e:
        smallest = smallest_world(full, check)
        fix = (f"no smaller world works; only {c.parallel.elastic_world} processes do" if smallest is None else
               f"the smallest world that works is {smallest} process{'es' if smallest > 1 else ''}")
        cp = f" cp={full.parallel.cp}" if full.parallel.cp > 1 else ""
        raise NoLayout(str(e), f"the layout written for {c.parallel.elastic_world} processes "
                       f"(dp={full.parallel.dp}{cp} tp={full.parallel.tp} pp={full.parallel.pp} microbatches="
                       f"{full.train.microbatches}) cannot be re-derived for the {world} processes left "
                       f"({e}); {fix}") from None


def smallest_world(full: C, check: Callable[[C, int], C]) -> int | None:
    """The smallest world (a multiple of cp x tp x pp below the full one) the layout re-derives for."""
    per_replica = full.parallel.cp * full.parallel.tp * full.parallel.pp
    for world in range(per_replica, full.parallel.elastic_world or full.parallel.dp * per_replica, per_replica):
        try:
            _layout_for(full, world, check)
            return world
        except ConfigError:
            continue
    return None


def _layout_for(full: C, world: int, check: Callable[[C, int], C]) -> C:
    p, t = full.parallel, full.train
    per_replica = p.cp * p.tp * p.pp  # one replica's ranks: dp alone shrinks
    if world < per_replica or world % per_replica:
        cp = f"cp={p.cp} x " if p.cp > 1 else ""
        raise ConfigError("parallel", f"{cp}tp={p.tp} x pp={p.pp} = {per_replica} does not divide {world}")
    dp = world // per_replica
    micro = t.global_batch // (p.dp * t.microbatches)  # sequences per micro-batch: kept
    if t.global_batch % (dp * micro):
        raise ConfigError("train.global_batch", f"{t.global_batch} sequences are not a whole number of "
                          f"micro-batches of {micro} for dp={dp}")
    shrunk = replace(full, parallel=replace(p, dp=dp, elastic_world=0),
                     train=replace(t, microbatches=t.global_batch // (dp * micro)))
    return check(shrunk, world)


def check_node_counts(cfg: C, low: int, high: int, nproc: int, check: Callable[[C, int], C]) -> C:
    """An elastic launch of `low`..`high` nodes of `nproc` processes: the config written for
    `high` nodes, checked by `check` (Config.validate) now for every count the job may shrink to
    (exit 2 naming the smallest node count that works)."""
    elastic = replace(cfg, parallel=replace(cfg.parallel, elastic_world=high * nproc))
    full = check(elastic, high * nproc)
    for nodes in range(low, high):
        try:
            check(elastic, nodes * nproc)
        except NoLayout as e:
            works = next((n for n in range(nodes + 1, high + 1) if _fits(elastic, n * nproc, check)), high)
            raise ConfigError("", f"--nnodes {low}:{high}: the layout (dp={full.parallel.dp} tp={full.parallel.tp} "
                              f"pp={full.parallel.pp}) cannot be re-derived for {nodes} node{'s' if nodes > 1 else ''}"
                              f" of {nproc} processes ({e.reason}); the smallest node count that works is {works}: "
                              f"use --nnodes {works}:{high}") from None
    return full


def _fits(cfg: C, world: int, check: Callable[[C, int], C]) -> bool:
    try:
        check(cfg, world)
        return True
    except ConfigError:
        return False
