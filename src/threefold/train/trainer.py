"""The training loop: orchestration only (the math lives in step.py, strategies in parallel/)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import Checkpointer, TrainingState, import_model, read_manifest
from ..checkpoint.dcp import import_dcp, is_dcp
from ..checkpoint.format import layout_record, step_dir_name
from ..checkpoint.hf import pretrained
from ..checkpoint.logit_check import pretrained_check_line
from ..comm import Comm
from ..config import Config
from ..data.build import build_samplers
from ..data.loader import Loader, bound_ids
from ..errors import UserError
from ..launch.signals import PREEMPTED_EXIT
from ..mesh import BATCH, PIPELINE, SEQUENCE, Layout, Mesh, init_distributed, local_world_size, pick_device
from ..models.mtp import mtp_figures, mtp_tally
from ..models.registry import model_spec
from ..observe.determinism import configure_determinism, restore, set_deterministic_environment
from ..observe.faults import FaultInjector, first_attempt
from ..observe.goodput import AttemptRecord
from ..observe.memory import storage_bytes
from ..observe.nonfinite import PoisonedSaves
from ..observe.observer import Observer, process_group_timeout_s
from ..parallel import parallelize
from ..parallel.expert import router_metrics
from ..parallel.precision import set_tf32
from .autosave import AutoSave
from .clock import Mark, StepClock
from .evaluate import Evaluator
from .metrics import MetricsLog, plot_run
from .preempt import Preempted, StopSignals
from .rundir import check_resume, read_run, run_directory, update_run
from .step import Device, LaunchedStep, StepResult, TorchDevice, make_step
from .summary import print_summary
from .threads import share_cpu_threads


class Trainer:
    """Builds the mesh, the parallel model, the optimizer and the data; runs the steps.

    `stop`: this process's stop signals (train/preempt.py); on one, the world stops at the next
    step boundary, saves and `run` raises Preempted. None: nothing stops the run.
    """

    def __init__(self, cfg: Config, stop: StopSignals | None = None):
        began = time.time(), time.perf_counter()  # this attempt's start (observe/goodput.py)
        device = pick_device(cfg.run.device)
        if cfg.train.deterministic:
            set_deterministic_environment()  # read by NCCL / cuBLAS when they start
        init_distributed(device, process_group_timeout_s(cfg))
        self.cfg = cfg = cfg.for_device(device.type).validate(dist.get_world_size())
        threads = share_cpu_threads(cfg.run.threads)  # (count, source): printed and in DIR/run.json below
        set_tf32(device, cfg.precision.tf32)
        self._determinism = configure_determinism(cfg.train.seed, cfg.train.deterministic)
        p = cfg.parallel
        node_size = local_world_size() if cfg.compress.hierarchical or p.zero_hpz else 0  # dp_intra / dp_inter
        self.mesh = Mesh(Layout.of(p), device, node_size)
        self.device: Device = TorchDevice(device)  # the figures' copy to the host, the memory peak
        self.comm = Comm(self.mesh, history=cfg.debug.history, semantics=cfg.debug.comm_semantics)
        self.inter_node_axes = self.mesh.inter_node_axes(local_world_size())  # their bytes cross nodes
        self.out = run_directory(cfg)
        self.is_writer = self.mesh.global_rank == 0
        self.attempt = AttemptRecord(self.out, self.is_writer, *began)  # DIR/goodput.json: where the time went
        if self.is_writer and read_run(self.out) is not None:  # a claimed run directory (a library run may have none)
            update_run(self.out, "threads", {"count": threads[0], "from": threads[1]})
        t = cfg.train
        self.sampler, val_sampler = build_samplers(cfg.data, t.seq_len, t.global_batch, t.seed, cfg.model.vocab,
                                                   validation=t.eval_every > 0)
        self.loader = Loader(self.sampler, t.microbatches, self.mesh.rank("dp"), self.mesh.size("dp"), device,
                             cfg.data.prefetch)
        # the model's spec (built on the meta device by parallelize: each rank allocates only its
        # shards), with the pretrained weights of a Hugging Face directory when it has them
        spec = pretrained(model_spec(cfg.model, cfg.train.seed))
        self.parallel = parallelize(spec, self.mesh, self.comm, cfg)
        # AdamW or momentum SGD with fp32 masters over the pieces this rank owns (whole parameters, or ZeRO shards);
        # 1-bit Adam takes its place when compress.method=onebit asks for it
        self.optimizer = self.parallel.make_optimizer(cfg.train)
        # the step the pipeline schedule's registration names (schedules/table.py), else TrainStep; the
        # metrics reduction is the step's (an unflushed schedule's posts it and reads it one step later)
        self.step_fn = make_step(self.parallel, self.optimizer, self.comm, cfg.train)
        self.reduce_figures = self.step_fn.reduce_figures
        self.global_tokens = cfg.train.global_batch * cfg.train.seq_len
        self.evaluator = None if val_sampler is None else Evaluator(  # validation loss, train.eval_every
            val_sampler, cfg.train, self.parallel.module, self.comm,
            self.parallel.forward_backward if self.parallel.pipeline is not None else None,
            self.parallel.grad_sync.zero_grad, self.parallel.documents)
        self.stop = stop if stop is not None else StopSignals()
        self.stopping = False  # the world agreed to stop at the step just finished
        self._saved_step = -1  # the step of the last save
        self.poisoned = PoisonedSaves(self.is_writer)  # no save of a non-finite step (observe/nonfinite.py)
        self.faults = FaultInjector(cfg.fault, self.mesh.layout, self.mesh.global_rank, self.parallel.module,
                                    cfg.model.vocab, self.stop)
        self.observer = Observer(cfg, self.mesh, self.comm, self.parallel, self.out)
        self.step = 0  # optimizer steps launched (a step's update is issued when it is launched)
        self.clock = StepClock(device)
        self._last_end: Mark | None = None  # when the previous step's work ended
        # State outside parameters and optimizer that checkpoints carry (e.g. {"loss_scaler": scaler}):
        # objects with state_dict() / load_state_dict() of plain JSON values.
        self.stateful: dict[str, object] = dict(self.parallel.stateful)
        self.checkpointer = Checkpointer(self.out / "checkpoints", self.mesh, self.comm, cfg.checkpoint.keep,
                                         cfg.checkpoint.async_save, cfg.run.collective_timeout_s,
                                         cfg.checkpoint.peer_copy)
        self.checkpointer.guard(self.optimizer)  # an async snapshot overlaps forward/backward, not the update
        self.resumed_from: Path | None = None
        self._restore()
        if self.is_writer and spec.weights is not None and self.resumed_from is None and not cfg.checkpoint.init_from:
            print(f"threefold: {pretrained_check_line(spec, cfg.model.vocab)}", file=sys.stderr, flush=True)
        self.autosave = AutoSave(cfg.checkpoint, self.mesh.world_size, cfg.train.steps, self.step,
                                 self._agree_max) if cfg.checkpoint.save_every == "auto" else None
        if self.is_writer:  # once the run is built: a refused model or layout stays one line
            print(f"threads: {threads[0]} (from {threads[1]})", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ checkpoints

    def training_state(self) -> TrainingState:
        self.parallel.settle()  # ZeRO-1/2: the parameter all-gathers of the last step are complete
        return TrainingState(*self.parallel.checkpoint_tensors(),
                             self.optimizer, self.stateful, rank_state=self.parallel.rank_state,
                             rank=self.mesh.global_rank, layout=self._checkpoint_meta()["layout"])

    def _restore(self) -> None:
        """Resume from a checkpoint (parameters, optimizer, RNG, data position = step), or start
        from an exported model file, or from the seeded initialisation."""
        ck = self.cfg.checkpoint
        path = self.checkpointer.find_resume(ck.resume)
        if path is not None:
            if not is_dcp(path):  # a DCP directory names no model: its keys and shapes are checked as it loads
                check_resume(path, read_manifest(path).config, self.cfg)  # only this run's state, or the same model's
            manifest = self.checkpointer.load(path, self.training_state())
            self.step = manifest.step
            self.optimizer.after_load(manifest.step, any(n.endswith("/master") for n in manifest.tensors))
            self.resumed_from = path
            if self.is_writer:
                print(f"threefold: resumed from {path} (step {manifest.step}, written with "
                      f"{' '.join(f'{k}={v}' for k, v in manifest.layout.items())})", file=sys.stderr, flush=True)
                self._warn_data_mismatch(manifest.data)
        elif ck.init_from:
            self.parallel.settle()  # nvme under ZeRO-3: the shards in memory to be filled
            (import_dcp if is_dcp(ck.init_from) else import_model)(
                Path(ck.init_from), list(self.parallel.module.named_parameters()), self.parallel.placements)
            self.optimizer.after_load(0, masters_loaded=False)  # masters not sharing the model's storage: from it
            if self.is_writer:
                print(f"threefold: initialised the model from {ck.init_from} (checkpoint.init_from)", file=sys.stderr,
                      flush=True)

    def _warn_data_mismatch(self, data: dict) -> None:
        t = self.cfg.train
        changed = [f"{k} {data[k]} -> {v}" for k, v in (("global_batch", t.global_batch), ("seq_len", t.seq_len),
                                                        ("seed", t.seed)) if k in data and data[k] != v]
        if changed:
            print(f"threefold: warning: the checkpoint was written with other data settings ({', '.join(changed)}); "
                  "the continued run is not the run that would have happened", file=sys.stderr, flush=True)

    def _checkpoint_meta(self) -> dict:
        cfg, p = self.cfg, self.cfg.parallel
        return {"layout": layout_record(self.mesh.layout, p.zero),
                # the sampler is a pure function of the step: the step is the whole data position
                "data": {"step": self.step, "samples": self.step * cfg.train.global_batch,
                         "global_batch": cfg.train.global_batch, "seq_len": cfg.train.seq_len, "seed": cfg.train.seed,
                         "position": self.sampler.state(self.step)},  # epoch and position (per mixture source)
                "config": cfg.to_dict()}

    def save_checkpoint(self) -> None:
        fault = self.cfg.fault
        dies_here = (fault.kind == "kill_in_save" and fault.rank == self.mesh.global_rank
                     and fault.step == self.step and first_attempt())
        kill = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if dies_here else None  # halfway through its file
        self.step_fn.drain()  # the flush of an unflushed schedule: the saved state has every update applied
        self.checkpointer.save(self.step, self.training_state(), self._checkpoint_meta(), kill)
        self._saved_step = self.step
        self.poisoned.owed = False

    def _newest_checkpoint(self) -> str:
        saved = self._saved_step
        newest = self.checkpointer.root / step_dir_name(saved) if saved >= 0 else self.resumed_from
        return str(newest) if newest is not None else "none (nothing saved yet)"

    def _save_due(self, step: int) -> bool:
        if self.poisoned.owed:  # refused on a non-finite step: the next finite one saves
            return True
        if self.autosave is not None:
            return self.autosave.due(step)
        every = self.cfg.checkpoint.save_every
        return every > 0 and (step % every == 0 or step == self.cfg.train.steps)

    def _save(self, record: dict) -> None:
        """Save the step of `record` unless it is not finite; its stall in `record`; under save_every=auto, set the next."""
        if self.poisoned.refuses(record, self._newest_checkpoint()):  # a non-finite step: not saved
            return
        start = time.perf_counter()
        self.save_checkpoint()
        record["save_stall_s"] = time.perf_counter() - start  # what training waited (async: the snapshot)
        if self.autosave is None:
            return
        advice = self.autosave.after_save(self.step, record["save_stall_s"])
        if self.is_writer:
            update_run(self.out, "checkpoint_interval", self.autosave.record())
            if advice is not None:
                m = self.autosave.measured
                print(f"threefold: save_every=auto at step {self.step}: {advice.describe()}; measured save "
                      f"{m['save_s']:.3g} s, step {m['step_s']:.3g} s, {self.mesh.world_size} GPUs of MTBF "
                      f"{self.cfg.checkpoint.mtbf_hours:g} h", file=sys.stderr, flush=True)

    def _agree_max(self, values: list[float]) -> list[float]:
        """The element-wise maximum of `values` over every rank."""
        t = torch.tensor(values, dtype=torch.float64, device=self.mesh.device)
        for axis in self.mesh.axis_names:
            self.comm.all_reduce(t, axis, op=dist.ReduceOp.MAX, tag="checkpoint")
        return t.tolist()

    def memory(self) -> dict:
        """Bytes this rank holds, each storage counted once: model states and the step's activations.

        `optimizer` is what stays in the compute device's pool (fp32 masters not shared with the
        model, Adam moments or SGD momentum); with `parallel.offload`, `offloaded` is what moved to the host pool
        (with nvme: only what a checkpoint read back), and `scratch` (nvme) the bytes in the scratch files.
        """
        params = storage_bytes(self.parallel.param_tensors())
        grads = storage_bytes(self.parallel.grad_tensors())
        states = storage_bytes(self.optimizer.state_tensors())
        optim, offloaded = (0, states) if self.optimizer.offload else (states, 0)
        activations = self.parallel.meter.peak
        peak = self.device.memory_peak()  # the allocator's, since this step began (CUDA)
        if peak is None:
            peak = params + grads + optim + activations
        mem = {"params": params, "grads": grads, "optimizer": optim, "activations": activations, "peak": peak}
        if self.optimizer.offload:
            mem["offloaded"] = offloaded
        if self.optimizer.scratch_nbytes:  # parallel.offload=nvme: the states in the scratch file
            mem["scratch"] = self.optimizer.scratch_nbytes
        if self.parallel.activation_offload is not None:  # remat.offload=cpu: saved activations held on the host
            mem["activations_host"] = self.parallel.activation_offload.host_peak
        return mem

    def train_one_step(self) -> dict:
        """Run one step and read its figures (the synchronous form of `launch_step` + `finish_step`)."""
        return self.finish_step(self.launch_step())

    def launch_step(self) -> LaunchedStep:
        """Issue the next step: data, forward/backward, sync, update, the loss all-reduce. Nothing is
        read back to the host; what the host already knows is recorded now (bytes, memory, timing)."""
        step = self.step + 1
        self.device.reset_memory_peak()  # the peak of this step alone, not of the evaluations and saves before
        self.observer.step_begin(step)
        start, stalled = self.clock.mark(), self.checkpointer.last_stall_s  # it grows when an update waits for a snapshot
        self.faults.step_start(step)
        micro_batches, data_wait = self.loader.get(step - 1)
        micro_batches, token_ids = bound_ids(micro_batches, self.cfg.model.vocab)
        micro_batches = self.faults.batches(step, micro_batches)
        result = self.step_fn(step, micro_batches, self.global_tokens)
        # the loss and the stop flag in one all-reduce: agreeing on a stop costs no extra sync
        stop = result.loss_sum.new_full((1,), float(self.stop.first is not None))
        reduced = torch.cat([result.loss_sum.reshape(1), stop])
        if self.faults.skips_collective(step):
            self.faults.stall()
        # over the world and on its way to the host before anything of the next step (or posted and read one
        # step later: the step's `reduce_figures`), with the step's largest token id (lowest if negative)
        figures = self.reduce_figures(result, reduced, {"token_id": token_ids}, self.device)
        self.faults.step_end(step)
        self.step = step
        mem = self.memory()
        moe = router_metrics(self.parallel.module, self.comm, self.parallel.pipeline is not None) \
            if self.parallel.routers else None  # the `moe` metrics of the step
        # multi-token prediction's depths (on the last pipeline stage: zeros elsewhere)
        mtp = mtp_tally(self.parallel.module, self.mesh.device, self.cfg.model.mtp_depth)
        if mtp is not None:
            for over in (self.mesh.axes_where(PIPELINE), self.mesh.axes_where(BATCH, SEQUENCE)):
                self.comm.all_reduce_over(mtp, over, tag="metrics")
        comm = self.comm.traffic.take_window()  # this step's bytes, before the next step adds its own
        return LaunchedStep(step, result, figures, start, self.clock.mark(),
                            sum(mb.targets.numel() for mb in micro_batches), data_wait,
                            self.checkpointer.last_stall_s - stalled, mem, moe, comm, mtp)

    @staticmethod
    def figures(result: StepResult, loss_sum: torch.Tensor) -> dict:
        """The numbers a step's record reads from the device, by name (a device tensor or a number)."""
        return {**result.figures(), "loss_total": loss_sum}

    def finish_step(self, launched: LaunchedStep) -> dict:
        """Read a launched step's figures (waits for it) and make its metrics record.

        Its time runs from the end of the previous step's work (or from its own launch, when that is
        later) to the end of its own work (train/clock.py): consecutive steps' times add up to the wall
        time between their ends, and what ran between steps (an evaluation, a save) is no step's."""
        step, result = launched.step, launched.result
        figures = launched.figures.values()  # waits for the step's copy alone, not for the steps issued since
        grad_norm, skipped, loss_scale = figures["grad_norm"], figures["skipped"], figures["loss_scale"]
        loss_total, token_id = figures["loss_total"], figures["token_id"]
        self.stopping = self.stopping or figures["stop"] > 0  # the same value on every rank: the world agrees
        if not 0 <= token_id < self.cfg.model.vocab:  # read with the step's figures (above): no extra wait
            self._bad_token(step, int(token_id))
        elapsed = self.clock.step_time(launched.start, launched.end, self._last_end)
        self._last_end = launched.end
        targets = figures.get("targets", self.global_tokens)  # packed rows (data.pack): the counted targets
        record = {"step": step, "loss": loss_total / targets, "grad_norm": grad_norm, "lr": result.lr,
                  "tokens": self.global_tokens, "tokens_per_s": self.global_tokens / elapsed,
                  "world_size": self.mesh.world_size, "microbatches": self.cfg.train.microbatches,
                  "step_time_s": elapsed, "data_wait_s": launched.data_wait_s, "skipped": bool(skipped),
                  "loss_scale": loss_scale, "mem": launched.mem, "time": time.time()}
        if launched.save_wait_s > 0:
            record["save_wait_s"] = launched.save_wait_s
        if self.cfg.data.pack:
            record["targets"] = int(targets)
        record.update(self.observer.step_end(step, result.loss_sum, grad_norm, launched.local_tokens))
        if launched.moe is not None:
            record["moe"] = launched.moe
        if launched.mtp is not None:  # read with the step's figures (the wait above): `mtp_loss`, `mtp_ce`
            record.update(mtp_figures(launched.mtp, targets))
        record["comm"] = launched.comm
        if self.step == step:  # no step launched since: the bytes sent since its launch (observer's) are its own
            for axis, ops in self.comm.traffic.take_window().items():
                into = record["comm"].setdefault(axis, {})
                for op, n in ops.items():
                    into[op] = into.get(op, 0) + n
        if self.mesh.world_size > local_world_size():  # several nodes: the bytes of axes that cross them
            record["comm_inter_node"] = {a: sum(ops.values()) for a, ops in record["comm"].items()
                                         if a in self.inter_node_axes}
        return record

    def _bad_token(self, step: int, token_id: int) -> None:
        """A token id outside the vocabulary (its lookups read id 0 instead: no checkpoint follows)."""
        d, vocab = self.cfg.data, self.cfg.model.vocab
        source = f"data.sources '{d.sources}'" if d.sources else f"data.source '{d.source}'"
        raise UserError(f"data: step {step} read token id {token_id} from {source}, outside the model's vocabulary "
                        f"of {vocab} (ids 0..{vocab - 1}); prepare the data with the model's tokenizer, or give "
                        "the model a vocabulary that covers the data (model.vocab)")

    def _may_defer(self) -> bool:
        """Whether the step just launched may be read after the next one is launched: nothing needs
        its figures or this exact state before then (a save, an evaluation, the last step, the
        debugging tools' per-step checks, an injected fault, a stop)."""
        return not (self.step >= self.cfg.train.steps or self._save_due(self.step) or self.stopping
                    or (self.evaluator is not None and self.evaluator.due(self.step))
                    or self.observer.checks_each_step or self.cfg.fault.rank >= 0)

    def _complete(self, record: dict, log: MetricsLog | None) -> None:
        """After a step's figures are read: evaluation, the metrics line, the checkpoint, when due."""
        step = record["step"]
        if self.autosave is not None:
            self.autosave.record_step(record["step_time_s"])
        if self.evaluator is not None and self.evaluator.due(step):
            began = time.perf_counter()
            record.update(self.evaluator())  # reads its loss: done when it returns
            record["eval_time_s"] = time.perf_counter() - began
        if self._save_due(step):
            self._save(record)  # before the line: it holds the save's stall
        if log is not None:
            log.write(record)

    def run(self) -> list[dict]:
        """Train to cfg.train.steps; returns every step's record (on every rank)."""
        cfg = self.cfg
        if cfg.train.steps == 0:
            return self._save_step_zero()
        self.attempt.begin(self.step)  # the lines after this step are dropped (a crashed attempt's: recomputed)
        log = MetricsLog(self.out, cfg, self.step + 1) if self.is_writer else None
        if log is not None:
            (self.out / "config.toml").write_text(cfg.to_toml())  # the resolved config of this run
        records, outcome = [], "failed"
        self.observer.start()
        try:
            pending = None  # a launched step whose figures are read after the next step is launched
            while self.step < cfg.train.steps and not self.stopping:
                launched = self.launch_step()
                if pending is not None:  # nothing was due at its step (`_may_defer`)
                    records.append(self.finish_step(pending))
                    self._complete(records[-1], log)
                    pending = None
                if self._may_defer():
                    pending = launched
                    continue
                records.append(self.finish_step(launched))
                self._complete(records[-1], log)
            self.step_fn.drain()  # an unflushed schedule's last update (a no-op for synchronous steps)
            stopped = self.stopping and self.step < cfg.train.steps  # a signal: save this step, then stop
            if stopped and self._saved_step != self.step and not (
                    records and self.poisoned.refuses(records[-1], self._newest_checkpoint())):
                began = time.perf_counter()
                self.save_checkpoint()
                self.attempt.add("preemption", time.perf_counter() - began)
            self.parallel.complete()  # the last step's communication done (nvme under ZeRO-3: shards in the file)
            if stopped or cfg.checkpoint.save_every == "auto" or cfg.checkpoint.save_every > 0:
                began = time.perf_counter()
                self.checkpointer.close()  # an async save is written
                self.attempt.add("preemption" if stopped else "checkpoint", time.perf_counter() - began)
            self.observer.finish()
            outcome = "preempted" if stopped else "completed"
        finally:
            self.loader.close()
            self.observer.stop()
            restore(self._determinism)
            if log is not None:
                log.close()
            self.attempt.end(outcome)
        if stopped:
            raise self._preempted()
        if log is not None and cfg.run.plot and records:
            plot_run(log.path, self.out)
        if self.parallel.pipeline is not None and cfg.run.plot and records:
            self._export_pipeline_timeline()
        if log is not None:
            print_summary(self.out)
        return records

    def _preempted(self) -> Preempted:
        name = self.stop.first.name if self.stop.first is not None else "a stop signal to another rank"
        saved = self._saved_step == self.step  # else a non-finite step: nothing saved (`poisoned` said why)
        stopped = Preempted(name, self.step, Path(self._newest_checkpoint()))
        if self.is_writer:
            print(stopped.line() if saved else f"threefold: {name} at step {self.step}: saved nothing (the step is "
                  f"not finite); the newest checkpoint is {stopped.checkpoint}; exit {PREEMPTED_EXIT} (preempted) - "
                  "continue with --resume auto", file=sys.stderr, flush=True)
        return stopped

    def _save_step_zero(self) -> list[dict]:
        """train.steps=0: the initialised (or loaded: a Hugging Face directory, checkpoint.init_from) model
        is saved as the step-0 checkpoint, untouched by any step, for `ckpt export`; nothing is trained."""
        try:
            if self.is_writer:
                (self.out / "config.toml").write_text(self.cfg.to_toml())
            self.save_checkpoint()
            self.checkpointer.close()
        finally:
            self.loader.close()
            restore(self._determinism)
        if self.is_writer:
            print(f"threefold: train.steps=0: saved the initial model as {self.out / 'checkpoints'} step 0; "
                  "nothing was trained", file=sys.stderr, flush=True)
        return []

    def _export_pipeline_timeline(self) -> None:
        """The last step's measured schedule: DIR/pipeline.png and DIR/pipeline-trace.json (Chrome/Perfetto)."""
        from ..pipeline.draw import chrome_trace, draw_timeline

        events = self.parallel.pipeline.gathered_timeline()  # collective over pp: every rank calls it
        if self.is_writer:
            p = self.cfg.pipeline
            title = f"{p.schedule} pp={self.mesh.size('pp')} m={self.cfg.train.microbatches} (measured, step {self.step})"
            draw_timeline(events, self.mesh.size("pp"), self.out / "pipeline.png", title, unit="seconds")
            chrome_trace(events, self.out / "pipeline-trace.json")


def train(cfg: Config, stop: StopSignals | None = None) -> list[dict]:
    return Trainer(cfg, stop).run()
