"""The training step of PipeDream-2BW (pipeline/two_bw.py): each stage steps alone, inside the schedule.

A call runs step t's segment of the timeline: the forwards of batch t (whose loss the step
reports), the tail of batch t - 1's backwards and, on every stage, the update with batch t - 1's
gradient (`U`), then the head of batch t's backwards. The update at U is the synchronous step's
math restricted to one stage: the dp sync of its gradients (its dp peers reach the same U), the
norm of its own gradients (summed over dp), clipping by that norm, learning rate `lr_at(k)` for
the k-th update (k = t - 1: the learning-rate schedule follows the batches), the optimizer step,
unless the stage's gradient is not finite.

Clipping (`train.grad_clip` = c > 0) is per stage: no stage has the global norm when it steps
(the other stages finish the batch at other times; waiting for them is a flush). Stage s scales
its gradient g_s by min(1, c / (||g_s|| + 1e-6)), torch's `clip_grads_with_norm_` with the
stage's own norm in place of the global one. A stage is clipped only where the synchronous step
would clip too (||g_s|| > c implies ||g|| > c), each stage by its own factor, so the applied
update's global norm may reach sqrt(pp) * c. It changes the optimisation, as the staleness does
(docs/pipeline.md).

Nothing is summed over pp here. The stages' [squared norm, not finite] of the update they
applied (`stage_figures`) go with the metrics reduction, which `reduce_figures` posts without a
wait and the trainer reads one step later: `grad_norm` of step t is the global norm of
the gradient applied in step t, before clipping (batch t - 1's; 0 at the first step after a
flush, which applies none), `lr` the rate it was applied with (0 when none), `skipped` whether a
stage skipped it. `drain()` is the flush: the last batch's remaining backwards and its update
(lr_at(t)), before a checkpoint and at the end.

Under context parallelism (cp > 1) each call splits the micro-batches into this rank's zigzag
parts first (`step.split_sequences`, as the synchronous step does); a stage's cp ranks run the
same timeline, so they reach U together, and the gradient sync at U reduces over dp and cp
(the mesh's replica axis), the norm counts each replicated gradient once (`grad_sum_of_squares`).
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..config import TrainConfig
from ..mesh import BATCH, PIPELINE, SEQUENCE
from ..parallel import ParallelModel
from ..parallel.master import ShardedOptimizer
from .optim import lr_at, set_lr
from .step import Device, Figure, PostedRead, StepResult, TrainStep, grad_sum_of_squares


def stage_sumsq(params, placements, comm: Comm, dp_axis: str | None, replicated: bool) -> torch.Tensor:
    """The sum of squares of this stage's distinct gradient elements: `step.global_grad_norm` over
    tp and dp, without the sum over pp (the other stages step at other times)."""
    return grad_sum_of_squares(params, placements, comm, dp_axis, replicated, ("tp",))


class TwoBWStep(TrainStep):
    """`TrainStep`'s face (`step(t, micro_batches, tokens) -> StepResult`, `drain()`, `reduce_figures`) for
    pipedream-2bw: named by its registration (schedules/table.py `ScheduleKind.step`)."""

    def __init__(self, parallel: ParallelModel, optimizer: ShardedOptimizer, comm: Comm, cfg: TrainConfig):
        super().__init__(parallel, optimizer, comm, cfg)
        self.runtime = parallel.pipeline
        self.runtime.on_update = self._update
        self._step = 0  # the step whose segment ran last
        self._lr = 0.0  # the rate of the update applied in this call (0: none)
        self._applied = torch.zeros(2, dtype=torch.float32, device=comm.mesh.device)  # sumsq, not finite
        self.stage_figures = self._applied  # `_applied` of the last call (`__call__`)

    def __call__(self, step: int, micro_batches, global_tokens: int) -> StepResult:
        if not self.runtime.in_flight:
            self.grad_sync.zero_grad()
        self._step, self._lr = step, 0.0
        self._applied = torch.zeros(2, dtype=torch.float32, device=self.comm.mesh.device)
        # cp > 1: this rank's zigzag part of every micro-batch, as the synchronous step splits it (the
        # loss is summed over dp and cp by the trainer; the update's gradients are synced over dp+cp)
        micro_batches = self.split_sequences(micro_batches)
        loss_sum = self.runtime.forward_backward(micro_batches, global_tokens)
        # this stage's [sum of squares, not finite] of the update it applied; summed over pp with the
        # metrics, posted without a wait (`reduce_figures`; `global_figures` reads the sum)
        self.stage_figures = self._applied.clone()
        sumsq, bad = self.stage_figures.unbind()
        return StepResult(loss_sum, sumsq.sqrt(), self._lr, bad > 0, 1.0)  # this stage's own figures

    def reduce_figures(self, result: StepResult, reduced: torch.Tensor, extra: dict[str, Figure],
                       device: Device) -> PostedRead:
        """The metrics reduction, which makes no pipeline rank wait for another: summed over dp at once
        (the stage's replicas, in step with each other: they met at its update), then, with the stage's
        figures of the update it applied (`stage_figures`), over pp asynchronously: waited for when the
        step's figures are read, after the next step is launched (the trainer's `run`; at once when a
        save, the last step or a stop comes first). The sums are the synchronous ones."""
        mesh = self.comm.mesh
        self.comm.all_reduce_over(reduced, mesh.axes_where(BATCH, SEQUENCE), tag="metrics")
        summed = torch.cat([reduced, self.stage_figures])
        posted = self.comm.all_reduce_over(summed, mesh.axes_where(PIPELINE), async_op=True, tag="metrics")
        return PostedRead(posted, lambda: {**self.global_figures(summed[2:]), "loss_total": summed[0],
                                           "stop": summed[1], **extra}, device)

    @staticmethod
    def global_figures(summed: torch.Tensor) -> dict:
        """`StepResult.figures` of the step from `stage_figures` summed over pp: the global norm of
        the gradient applied in it, and whether a stage skipped its update."""
        return {"grad_norm": summed[0].sqrt(), "skipped": summed[1] > 0, "loss_scale": 1.0}

    def drain(self) -> None:
        """The flush: apply the last batch's update (lr_at of its step); nothing stays in flight."""
        self._step += 1  # the drain applies the update of the step that ran last
        self.runtime.drain()
        self._step -= 1

    def _update(self) -> None:
        """This stage's optimizer step with the batch it has just finished (run at its U)."""
        self.grad_sync.finish()
        params, placements = self.optimizer.prepare_grads(1.0)
        sumsq = stage_sumsq(params, placements, self.comm, self.parallel.norm_axis, self.grad_sync.replicated)
        found_inf = ~torch.isfinite(sumsq)
        self.optimizer.clip(params, sumsq.sqrt(), self.cfg.grad_clip)  # by this stage's own norm (module text)
        self._lr = lr_at(self._step - 1, self.cfg)
        set_lr(self.optimizer, self._lr)
        self.optimizer.step(found_inf)
        self.parallel.settle()
        self._applied = torch.stack([torch.where(found_inf, 0.0, sumsq), found_inf.float()])
        self.grad_sync.zero_grad()
