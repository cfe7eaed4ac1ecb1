"""PipeDream-2BW (Narayanan et al., *Memory-Efficient Pipeline-Parallel DNN Training*, ICML 2021).

1F1B without pipeline flushes: the 1F1B timeline runs on across steps, and each stage applies
the update of a batch (m micro-batches, m >= p) on its own as soon as it has run that batch's
last backward - action `U` in the timeline. Every micro-batch of batch t runs its forward and
its backward with one weight version, on every stage: version max(t - 1, 0) counted from the
last flush, so the updates are

    W(t + 1) = W(t) - lr * grad f(W(t - 1))        (staleness of one step; W(-1) = W(0))

Two versions per stage are kept (`WeightVersions`): the parameters the optimizer updates hold
the newest, and two slots hold the versions the micro-batches in flight compute with (the
forward reads a slot through `_Stashed`, an identity onto the parameter for autograd, so the
gradient still accumulates into the parameter and the gradient sync sees it as usual).

Schedules are data here too. `unrolled(p, m, batches)` is the whole timeline of `batches`
consecutive batches with the updates and the aligned posting of every transfer (posting.py);
`plan(p, m)` cuts it into what one training step runs: `first` (the warm-up, batch 0 after a
flush), `steady` (forwards of batch t, the backwards of the tail of batch t - 1, U(t - 1) and the
backwards of the head of batch t) and `drain` (the tail of the last batch and its update: the
one flush, at the end of training and before a checkpoint). `check_plan` proves that
first + steady x n + drain is exactly the unrolled timeline (which `validate` proves, host and
NCCL rules) and that no step waits for anything of a later step. See docs/pipeline.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from ..observe.memory import SavedTensorMeter
from ..schedules.actions import COMM, Action, Schedule, ScheduleError
from ..schedules.posting import add_aligned_communication
from ..schedules.two_bw_timeline import NAME, SHOWN, UPDATE, check_request, shown_order, unrolled_orders  # noqa: F401
from .runtime import InFlight, ModuleCompute, PipelineRuntime


@lru_cache(maxsize=64)
def unrolled(p: int, m: int, batches: int) -> Schedule:
    """The timeline of `batches` batches with updates and aligned transfers (U is a compute action
    for the lock-step posting: it takes its round, as it takes its time)."""
    ranks = add_aligned_communication(unrolled_orders(p, m, batches), p, 1)
    return Schedule(NAME, p, batches * m, 1, tuple(tuple(r) for r in ranks))


def without_updates(s: Schedule) -> Schedule:
    """`s` without its U actions: what `validate` reads (an update neither sends nor receives)."""
    return Schedule(s.name, s.pp, s.microbatches, s.virtual,
                    tuple(tuple(a for a in r if a.kind != UPDATE) for r in s.ranks))


def segment_of(a: Action, p: int, m: int) -> int:
    """The step (batch index) whose segment runs compute action `a`: F of batch b in b's, the
    backward paired with F(k) in 1F1B (k = mb + warm-up) in k's batch's, U(b) in b + 1's."""
    if a.kind == "F":
        return a.mb // m
    if a.kind == "B":
        return (a.mb + p - 1 - a.stage) // m
    return a.mb // m + 1  # U


def segments(s: Schedule, m: int) -> list[list[list[Action]]]:
    """rank -> the unrolled list cut into batches + 1 segments (the last is the drain). A run of
    transfers belongs to the segment of the compute action after it (trailing ones: the last)."""
    batches = s.microbatches // m
    out = []
    for r, actions in enumerate(s.ranks):
        cut: list[list[Action]] = [[] for _ in range(batches + 1)]
        pending: list[Action] = []
        last = 0
        for a in actions:
            if a.kind in COMM:
                pending.append(a)
                continue
            seg = min(segment_of(a, s.pp, m), batches)
            if seg < last:
                raise ScheduleError(f"{NAME} (pp={s.pp}, m={m}): rank {r} runs {a} of step {seg} after step {last}")
            last = seg
            cut[seg] += pending + [a]
            pending = []
        cut[last] += pending
        out.append(cut)
    return out


def _relative(actions: list[Action], offset: int) -> tuple[Action, ...]:
    return tuple(Action(a.kind, a.stage, a.mb - offset) for a in actions)


@dataclass(frozen=True)
class Plan:
    """What one step runs, per rank; micro-batch ids relative to the step's batch (its i is i, the
    previous batch's i is i - m). `drain` is relative to the last batch that ran."""

    p: int
    m: int
    first: tuple[tuple[Action, ...], ...]
    steady: tuple[tuple[Action, ...], ...]
    drain: tuple[tuple[Action, ...], ...]

    def run(self, steps: int) -> list[list[Action]]:
        """rank -> first + steady x (steps - 1) + drain, in absolute micro-batch ids."""
        out = []
        for r in range(self.p):
            seq = list(_relative(self.first[r], 0))
            for t in range(1, steps):
                seq += _relative(self.steady[r], -t * self.m)
            out.append(seq + list(_relative(self.drain[r], -(steps - 1) * self.m)))
        return out


@lru_cache(maxsize=64)
def plan(p: int, m: int) -> Plan:
    """The three segment kinds, cut from the unrolled timeline of 3 batches; `check_plan` holds."""
    cut = segments(unrolled(p, m, 3), m)
    result = Plan(p, m, tuple(tuple(c[0]) for c in cut), tuple(_relative(c[1], m) for c in cut),
                  tuple(_relative(c[3], 2 * m) for c in cut))
    check_plan(result)
    return result


def check_plan(pl: Plan, lengths: tuple[int, ...] = (1, 2, 3, 4)) -> None:
    """Raise ScheduleError unless a run of n steps (first + steady x (n-1) + drain) is the unrolled
    timeline of n batches for each n in `lengths` (steps repeat: the steady segment is the same for
    every step) and no step needs anything of a later step: every message is sent no later than the
    step that consumes it, and its receive is posted in the step that sends it. The last makes a
    collective between two steps safe where it runs in order with the transfers (NCCL's one stream
    per communicator: the metrics reduction over pp, posted at each step's end, TwoBWStep.reduce_figures):
    every transfer before it on one rank is matched by a transfer before it on the other."""
    for n in lengths:
        want = unrolled(pl.p, pl.m, n)
        got = pl.run(n)
        for r in range(pl.p):
            if list(want.ranks[r]) != got[r]:
                raise ScheduleError(f"{NAME} (pp={pl.p}, m={pl.m}): rank {r}'s steps do not compose to the "
                                    f"unrolled timeline of {n} batches")
        cut = segments(want, pl.m)
        where: dict[tuple, int] = {}
        for r in range(pl.p):
            for seg, actions in enumerate(cut[r]):
                for a in actions:
                    where[(a.kind, a.stage, a.mb)] = seg
        for (kind, stage, mb), seg in where.items():
            if kind == "SEND_F":
                recv, consumer = ("RECV_F", stage + 1, mb), ("F", stage + 1, mb)
            elif kind == "SEND_B":
                recv, consumer = ("RECV_B", stage - 1, mb), ("B", stage - 1, mb)
            else:
                continue
            if not where[recv] == seg <= where[consumer]:
                raise ScheduleError(f"{NAME} (pp={pl.p}, m={pl.m}): {kind}{mb}@s{stage} in step {seg}, its receive "
                                    f"in step {where[recv]}, its consumer in step {where[consumer]}")


def check_updates(s: Schedule, m: int) -> None:
    """Every rank updates once per batch, right after that batch's last backward; no backward of
    that batch or an earlier one follows it (the gradient it applies is complete)."""
    for r, actions in enumerate(s.ranks):
        compute = [a for a in actions if a.kind not in COMM]
        updates = [i for i, a in enumerate(compute) if a.kind == UPDATE]
        if [compute[i].mb for i in updates] != [b * m + m - 1 for b in range(s.microbatches // m)]:
            raise ScheduleError(f"rank {r}: updates {[str(compute[i]) for i in updates]}, want one per batch")
        for i in updates:
            before, after = compute[i - 1], compute[i + 1:]
            if before != Action("B", r, compute[i].mb):
                raise ScheduleError(f"rank {r}: {compute[i]} follows {before}, not the batch's last backward")
            batch = compute[i].mb // m
            if any(a.kind == "B" and a.mb // m <= batch for a in after):
                raise ScheduleError(f"rank {r}: a backward of batch {batch} runs after its update")


# ---------------------------------------------------------------- weight versions


class _Stashed(torch.autograd.Function):
    """Forward: a stashed version of a weight (a view of its slot); backward: the gradient to the
    parameter itself, so it accumulates where the gradient sync and the optimizer look."""

    @staticmethod
    def forward(ctx, param, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def version_of_batch(batch: int, base: int) -> int:
    """The weight version batch `batch` (counted from the last flush, at version `base`) computes with."""
    return base + max(batch - 1, 0)


class WeightVersions:
    """Two stashed versions of this rank's trainable parameters; version v lives in slot v % 2.

    The parameters themselves hold the newest version (the optimizer updates them in place);
    `use(v)` points every module at slot v % 2 for one forward (or backward) and returns the id of
    the version that slot holds. `commit()` after an update copies the parameters into the slot of
    the new version: the slot of version v - 2, whose micro-batches have all run their backward."""

    def __init__(self, module: nn.Module):
        self.entries = [(mod, name, q) for mod in module.modules() for name, q in mod._parameters.items()
                        if q is not None and q.requires_grad]
        self.slots = [[q.detach().clone() for _, _, q in self.entries] for _ in range(2)]
        self.slot_version = [0, -1]
        self.latest = 0  # the version the parameters hold

    def tensors(self) -> list[torch.Tensor]:
        return [t for slot in self.slots for t in slot]

    @torch.no_grad()
    def restart(self) -> None:
        """After a flush (or a checkpoint load): the parameters' values are the newest version, in its slot."""
        slot = self.latest % 2
        torch._foreach_copy_(self.slots[slot], [q.detach() for _, _, q in self.entries])
        self.slot_version[slot] = self.latest

    @torch.no_grad()
    def commit(self) -> None:
        """The optimizer made a new version: into its slot (version latest - 1 stays in the other)."""
        self.latest += 1
        self.restart()

    @contextlib.contextmanager
    def use(self, version: int):
        slot = self.slots[version % 2]
        for (mod, name, q), value in zip(self.entries, slot):
            mod._parameters[name] = _Stashed.apply(q, value)
        try:
            yield self.slot_version[version % 2]
        finally:
            for mod, name, q in self.entries:
                mod._parameters[name] = q


# ---------------------------------------------------------------- compute and runtime


class VersionedCompute(ModuleCompute):
    """`ModuleCompute` whose forward and backward run with a weight version."""

    def __init__(self, module, adapter, grad_sync, meter, versions: WeightVersions):
        super().__init__(module, adapter, grad_sync, meter)
        self.versions = versions
        self.version = 0  # the version the next forward uses (set by the runtime)
        self.used = 0  # the id of the version the last forward or backward read

    def begin(self, global_tokens: int) -> None:
        self.scale = global_tokens  # activations of the previous batch stay held
        self.side_loss = 0.0

    def forward(self, stage, x, targets):
        version = self.version
        with self.versions.use(version) as self.used:
            out, state = super().forward(stage, x, targets)
        return out, (version, state)

    def backward(self, stage, state, grad):
        version, inner = state
        with self.versions.use(version) as self.used:
            return super().backward(stage, inner, grad)


class _Window:
    """This step's micro-batches under their absolute ids (micro-batch i of the step is `offset` + i);
    a receive of another step's micro-batch reads its shape off the step's first (all alike)."""

    def __init__(self, micro_batches, offset: int, first):
        self.micro_batches, self.offset, self.first = micro_batches, offset, first

    def __getitem__(self, mb: int):
        i = mb - self.offset
        return self.micro_batches[i] if self.micro_batches is not None and 0 <= i < len(self.micro_batches) \
            else self.first


class TwoBWRuntime(PipelineRuntime):
    """Runs one segment of the 2BW timeline per step through the shared posting loop
    (`PipelineRuntime.run_actions`); what is in flight stays between steps (`InFlight`)."""

    def __init__(self, split, compute: VersionedCompute, comm, dtype, pl: Plan):
        super().__init__(split.schedule, split.stages, compute, comm, split.activation_shape, dtype, None)
        self.plan = pl
        self.m = pl.m
        self.versions = compute.versions
        self.on_update = None  # callable(): the stage's optimizer step (set by the training step)
        self.own_actions = {UPDATE: self._update}
        self.batch = 0  # batches started since the last flush
        self.base = 0  # the version at the last flush
        self.in_flight = False
        self.log: list | None = None  # (kind, stage, absolute micro-batch, version id): when a list
        self.started = 0  # batches started in total (absolute micro-batch ids: started * m + i)
        self.flight = InFlight()
        self._first = None  # the last step's first micro-batch (the drain's receives read its shape)

    def forward_backward(self, micro_batches, global_tokens: int) -> torch.Tensor:
        if len(micro_batches) != self.m:
            raise ValueError(f"the schedule expects {self.m} micro-batches, got {len(micro_batches)}")
        if not self.in_flight:
            self.versions.restart()
            self.base, self.batch = self.versions.latest, 0
        segment = self.plan.steady if self.in_flight else self.plan.first
        self.compute.begin(global_tokens)
        self._first = micro_batches[0]
        self.compute.version = version_of_batch(self.batch, self.base)
        loss = self._segment(segment[self.rank], micro_batches)
        self.in_flight = True
        self.batch += 1
        self.started += 1
        return loss + self.compute.side_loss

    def drain(self) -> None:
        """The flush: the last batch's remaining backwards and its update; nothing stays in flight."""
        if not self.in_flight:
            return
        self.started -= 1  # the drain's ids are the last batch's
        self._segment(self.plan.drain[self.rank], None)
        self.started += 1
        self.flight.finish()
        self.in_flight = False

    def _segment(self, actions, micro_batches) -> torch.Tensor:
        """Run a segment (micro-batch ids relative to the step's batch) in absolute ids."""
        offset = self.started * self.m
        actions = [Action(a.kind, a.stage, a.mb + offset) for a in actions]
        receives, rest = self.split_receives(actions)
        return self.run_actions(receives, rest, _Window(micro_batches, offset, self._first), self.flight)

    def _update(self, a: Action) -> None:
        """U: the stage's optimizer step, then the new version into its slot."""
        self.on_update()
        self.versions.commit()

    def _compute(self, a, x, state, micro_batches, states: dict) -> tuple:
        out = super()._compute(a, x, state, micro_batches, states)
        if self.log is not None:
            self.log.append((a.kind, a.stage, a.mb, self.compute.used))
        return out


def make_runtime(split, comm, grad_sync, dtype, weights, compile_stage=None) -> TwoBWRuntime:
    """The 2BW interpreter for this rank of `split` (a pipeline.split.PipelineSplit): a `RuntimeFactory`
    (schedules/table.py names it in pipedream-2bw's registration)."""
    if compile_stage is not None:
        raise ValueError(f"{NAME} does not compile stages")
    versions = WeightVersions(split.module)
    if weights is None:
        weights = list(split.module.parameters()) + list(split.module.buffers())
    meter = SavedTensorMeter(exclude=list(weights) + versions.tensors())
    compute = VersionedCompute(split.module, split.adapter, grad_sync, meter, versions)
    return TwoBWRuntime(split, compute, comm, dtype, plan(split.schedule.pp, split.schedule.microbatches // SHOWN))
