"""The training loop: orchestration only (the math lives in step.py, strategies in parallel/)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import Comm
from ..config import Config
from ..data import Sampler, load_tokens
from ..mesh import Layout, Mesh, init_distributed, pick_device
from ..models.decoder import build_model
from ..observe.determinism import configure_determinism, restore, set_deterministic_environment
from ..observe.faults import FaultInjector
from ..observe.memory import optimizer_tensors, storage_bytes
from ..observe.observer import Observer, process_group_timeout_s
from ..parallel import parallelize
from .metrics import MetricsLog, plot_run
from .optim import make_optimizer
from .step import TrainStep


def share_cpu_threads(device: torch.device) -> None:
    """Give each local process its share of the cores (torch would start one thread per core in each)."""
    if device.type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))


class Trainer:
    """Builds the mesh, the parallel model, the optimizer and the data; runs the steps."""

    def __init__(self, cfg: Config):
        device = pick_device(cfg.run.device)
        if cfg.train.deterministic:
            set_deterministic_environment()  # read by NCCL / cuBLAS when they start
        init_distributed(device, process_group_timeout_s(cfg))
        share_cpu_threads(device)
        self.cfg = cfg = cfg.validate(dist.get_world_size())
        self._determinism = configure_determinism(cfg.train.seed, cfg.train.deterministic)
        p = cfg.parallel
        self.mesh = Mesh(Layout(dp=p.dp, tp=p.tp, pp=p.pp), device)
        self.comm = Comm(self.mesh, history=cfg.debug.history)
        self.out = Path(cfg.run.out)
        self.is_writer = self.mesh.global_rank == 0
        tokens = load_tokens(cfg.data.source, cfg.model.vocab, cfg.train.seed)
        self.sampler = Sampler(tokens, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed)
        model = build_model(cfg.model, cfg.train.seed, device)
        self.parallel = parallelize(model, self.mesh, self.comm, cfg)
        self.optimizer = make_optimizer(self.parallel.module.named_parameters(), cfg.train)
        self.step_fn = TrainStep(self.parallel.module, self.parallel.grad_sync, self.optimizer, self.comm,
                                 cfg.train, self.parallel.params, self.parallel.param_placements)
        self.global_tokens = cfg.train.global_batch * cfg.train.seq_len
        self.faults = FaultInjector(cfg.fault, (p.dp, p.tp, p.pp), self.mesh.global_rank, self.parallel.module,
                                    cfg.model.vocab)
        self.observer = Observer(cfg, self.mesh, self.comm, self.parallel, self.out)
        self.step = 0  # optimizer steps completed

    def memory(self) -> dict:
        module = self.parallel.module
        params = storage_bytes(module.parameters())
        grads = storage_bytes(p.grad for p in module.parameters())
        optim = storage_bytes(optimizer_tensors(self.optimizer))
        activations = self.step_fn.meter.peak
        peak = params + grads + optim + activations
        if self.mesh.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.mesh.device)
        return {"params": params, "grads": grads, "optimizer": optim, "activations": activations, "peak": peak}

    def train_one_step(self) -> dict:
        cfg = self.cfg
        step = self.step + 1
        self.observer.step_begin(step)
        start = time.perf_counter()
        self.faults.step_start(step)
        micro_batches = self.sampler.microbatches(step - 1, cfg.train.microbatches, self.mesh.rank("dp"),
                                                  self.mesh.size("dp"), self.mesh.device)
        micro_batches = self.faults.batches(step, micro_batches)
        result = self.step_fn(step, micro_batches, self.global_tokens)
        loss_sum = result.loss_sum.clone()
        if self.faults.skips_collective(step):
            self.faults.stall()
        self.comm.all_reduce(loss_sum, "dp", tag="metrics")
        loss = float(loss_sum) / self.global_tokens
        elapsed = time.perf_counter() - start
        self.faults.step_end(step)
        self.step = step
        record = {"step": step, "loss": loss, "grad_norm": result.grad_norm, "lr": result.lr,
                  "tokens": self.global_tokens, "tokens_per_s": self.global_tokens / elapsed,
                  "step_time_s": elapsed, "skipped": result.skipped, "mem": self.memory()}
        local_tokens = sum(mb.targets.numel() for mb in micro_batches)
        record.update(self.observer.step_end(step, result.loss_sum, result.grad_norm, local_tokens))
        record["comm"] = self.comm.traffic.take_window()
        return record

    def run(self) -> list[dict]:
        """Train to cfg.train.steps; returns every step's record (on every rank)."""
        cfg = self.cfg
        log = MetricsLog(self.out, cfg.run.progress, cfg.run.tensorboard, cfg.train.steps,
                         self.step + 1) if self.is_writer else None
        records = []
        self.observer.start()
        try:
            while self.step < cfg.train.steps:
                record = self.train_one_step()
                records.append(record)
                if log is not None:
                    log.write(record)
            self.observer.finish()
        finally:
            self.observer.stop()
            restore(self._determinism)
            if log is not None:
                log.close()
        if log is not None and cfg.run.plot and records:
            plot_run(log.path, self.out)
        return records


def train(cfg: Config) -> list[dict]:
    return Trainer(cfg).run()
