"""The training loop: orchestration only (the math lives in step.py, strategies in parallel/)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import Comm
from ..config import Config
from ..data import Sampler, load_tokens
from ..mesh import Layout, Mesh, init_distributed, pick_device
from ..models.decoder import build_model
from ..observe.memory import optimizer_tensors, storage_bytes
from ..parallel import parallelize
from .metrics import MetricsLog, plot_run
from .optim import make_optimizer
from .step import TrainStep


def configure_determinism(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


class Trainer:
    """Builds the mesh, the parallel model, the optimizer and the data; runs the steps."""

    def __init__(self, cfg: Config):
        device = pick_device(cfg.run.device)
        init_distributed(device, cfg.run.collective_timeout_s)
        self.cfg = cfg = cfg.validate(dist.get_world_size())
        configure_determinism(cfg.train.seed, cfg.train.deterministic)
        p = cfg.parallel
        self.mesh = Mesh(Layout(dp=p.dp, tp=p.tp, pp=p.pp), device)
        self.comm = Comm(self.mesh)
        self.out = Path(cfg.run.out)
        self.is_writer = self.mesh.global_rank == 0
        tokens = load_tokens(cfg.data.source, cfg.model.vocab, cfg.train.seed)
        self.sampler = Sampler(tokens, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed)
        model = build_model(cfg.model, cfg.train.seed, device)
        self.parallel = parallelize(model, self.mesh, self.comm, cfg)
        self.optimizer = make_optimizer(self.parallel.module.named_parameters(), cfg.train)
        pipeline = self.parallel.pipeline  # pp > 1: the schedule's runtime runs forward and backward
        self.step_fn = TrainStep(self.parallel.module, self.parallel.grad_sync, self.optimizer, self.comm,
                                 cfg.train, self.parallel.params, self.parallel.param_placements,
                                 forward_backward=pipeline.forward_backward if pipeline else None,
                                 meter=pipeline.meter if pipeline else None)
        self.global_tokens = cfg.train.global_batch * cfg.train.seq_len
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

    def _inject_fault(self, step: int) -> None:
        fault = self.cfg.fault
        if fault.rank == self.mesh.global_rank and fault.step == step:
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected fault on rank {fault.rank} at step {step}")

    def train_one_step(self) -> dict:
        cfg = self.cfg
        step = self.step + 1
        self._inject_fault(step)
        start = time.perf_counter()
        micro_batches = self.sampler.microbatches(step - 1, cfg.train.microbatches, self.mesh.rank("dp"),
                                                  self.mesh.size("dp"), self.mesh.device)
        result = self.step_fn(step, micro_batches, self.global_tokens)
        loss_sum = result.loss_sum.clone()
        for axis in ("pp", "dp"):  # only the last pipeline stage has a loss; other ranks add 0
            self.comm.all_reduce(loss_sum, axis, tag="metrics")
        loss = float(loss_sum) / self.global_tokens
        elapsed = time.perf_counter() - start
        self.step = step
        return {"step": step, "loss": loss, "grad_norm": result.grad_norm, "lr": result.lr,
                "tokens": self.global_tokens, "tokens_per_s": self.global_tokens / elapsed,
                "step_time_s": elapsed, "skipped": result.skipped,
                "mem": self.memory(), "comm": self.comm.traffic.take_window()}

    def run(self) -> list[dict]:
        """Train to cfg.train.steps; returns every step's record (on every rank)."""
        cfg = self.cfg
        log = MetricsLog(self.out, cfg.run.progress, cfg.run.tensorboard, cfg.train.steps,
                         self.step + 1) if self.is_writer else None
        records = []
        try:
            while self.step < cfg.train.steps:
                record = self.train_one_step()
                records.append(record)
                if log is not None:
                    log.write(record)
        finally:
            if log is not None:
                log.close()
        if log is not None and cfg.run.plot and records:
            plot_run(log.path, self.out / "loss.png")
        if self.parallel.pipeline is not None and cfg.run.plot and records:
            self._export_pipeline_timeline()
        return records

    def _export_pipeline_timeline(self) -> None:
        """The last step's measured schedule: DIR/pipeline.png and DIR/pipeline-trace.json (Chrome/Perfetto)."""
        from ..pipeline.draw import chrome_trace, draw_timeline

        events = self.parallel.pipeline.gathered_timeline()  # collective over pp: every rank calls it
        if self.is_writer:
            p = self.cfg.pipeline
            title = f"{p.schedule} pp={self.mesh.size('pp')} m={self.cfg.train.microbatches} (measured, step {self.step})"
            draw_timeline(events, self.mesh.size("pp"), self.out / "pipeline.png", title, unit="seconds")
            chrome_trace(events, self.out / "pipeline-trace.json")


def train(cfg: Config) -> list[dict]:
    return Trainer(cfg).run()
