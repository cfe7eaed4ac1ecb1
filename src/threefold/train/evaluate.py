"""Validation loss on the held-out split, under any layout.

Every evaluation reads the same `train.eval_batches` global batches of the validation split
(samples 0 .. eval_batches x global_batch - 1 of its sampler), each data-parallel rank its
slice, so the figure is comparable across steps and layouts. loss = summed token loss over
all of them / their token count (packed rows, `data.pack`: their counted targets); perplexity = exp(loss). Without pipeline parallelism the
forward runs under no_grad. With pp > 1 the schedule's runtime is the only way through the
stages: it runs forward and backward, and the gradients are thrown away (zeroed) before the
next training step, which zeroes them anyway.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..comm import Comm
from ..mesh import BATCH, PIPELINE, SEQUENCE
from ..config import TrainConfig
from ..data.sampler import Batch, Sampler
from ..models.forwards import evaluating
from ..parallel.model import Documents
from .step import counted_targets, hand_documents, split_sequences


class Evaluator:
    def __init__(self, sampler: Sampler, cfg: TrainConfig, module: nn.Module, comm: Comm,
                 pipeline_forward: Callable[[list[Batch], int], torch.Tensor] | None = None,
                 discard_grads: Callable[[], None] | None = None, documents: Documents | None = None):
        self.sampler, self.cfg, self.module, self.comm = sampler, cfg, module, comm
        self.pipeline_forward, self.discard_grads = pipeline_forward, discard_grads
        self.documents = documents  # packed rows: each micro-batch's ids and positions before its forward

    def due(self, step: int) -> bool:
        every = self.cfg.eval_every
        return every > 0 and (step % every == 0 or step == self.cfg.steps)

    def __call__(self) -> dict:
        mesh, cfg = self.comm.mesh, self.cfg
        tokens = cfg.eval_batches * cfg.global_batch * cfg.seq_len
        total = torch.zeros((), dtype=torch.float32, device=mesh.device)
        counted = torch.zeros((), dtype=torch.float64, device=mesh.device)  # packed rows: the counted targets
        for k in range(cfg.eval_batches):
            mbs = self.sampler.microbatches(k, cfg.microbatches, mesh.rank("dp"), mesh.size("dp"), mesh.device)
            mbs = split_sequences(mbs, self.comm, self.documents is not None)  # cp > 1: this rank's zigzag part
            if self.documents is not None:
                counted += counted_targets(mbs, self.comm, reduce=False)
            total += self._loss_sum(mbs, tokens)
        # tp ranks hold the same loss; only the last stage has one; the token shards (dp, cp) in one collective
        sums = total if self.documents is None else torch.stack([total.double(), counted])
        for over in (mesh.axes_where(PIPELINE), mesh.axes_where(BATCH, SEQUENCE)):
            self.comm.all_reduce_over(sums, over, tag="metrics")
        if self.documents is not None:
            total, tokens = sums[0], max(1, int(sums[1]))
        loss = float(total) / tokens
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}

    def _loss_sum(self, mbs: list[Batch], tokens: int) -> torch.Tensor:
        if self.pipeline_forward is not None:  # the training schedule: not a training forward for the routers
            with evaluating():
                loss = self.pipeline_forward(mbs, tokens).detach().float()
            self.discard_grads()
            return loss
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                return sum(self._forward(mb).float() for mb in mbs)
        finally:
            self.module.train(was_training)

    def _forward(self, mb: Batch) -> torch.Tensor:
        if self.documents is not None:  # packed rows: this micro-batch's document ids and positions first
            hand_documents(self.documents, mb)
        return self.module(mb.inputs, mb.targets)
