"""Functions run on every rank of a test world for the ZeRO / precision tests, and their helpers."""

from __future__ import annotations

import math

import torch

from tests.helpers import make_config


def train_stages(runs: list[list[str]], out: str, segment_min_bytes: int | None = None) -> list[dict]:
    """Train once per override list; report what the ZeRO tests check, per run.

    `segment_min_bytes`: ZeRO-1/2 cut even small buckets into segments (zero.py) when 0."""
    from threefold.parallel import zero
    from threefold.train.trainer import Trainer

    if segment_min_bytes is not None:
        zero.SEGMENT_MIN_BYTES = segment_min_bytes
    reports = []
    for overrides in runs:
        trainer = Trainer(make_config(overrides, out))
        records = trainer.run()
        sync = trainer.parallel.grad_sync
        report = {
            "losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "skipped": [r["skipped"] for r in records], "comm": [r["comm"] for r in records],
            "mem": records[-1]["mem"],
            "params": {n: p.detach().float().clone() for n, p in trainer.parallel.module.named_parameters()},
            "placements": dict(trainer.parallel.placements),
            "dtypes": {p.dtype for p in trainer.parallel.module.parameters()},
        }
        if hasattr(sync, "segments"):
            report["segments"] = [len(s) for s in sync.segments]
        if hasattr(sync, "peak_whole_numel"):
            report["peak_whole"] = sync.peak_whole_numel
            report["units"] = {u.name: sync.unit_numel(u) for u in sync.units}
            report["tied_units"] = [u.name for u in sync.units
                                    if sum(1 for h in sync.hooked if u in h.needs) > 1]
        reports.append(report)
        del trainer
    return reports


def assemble(per_rank: list[dict], placements: list[dict]) -> dict[str, torch.Tensor]:
    """The global parameters from every rank's local tensors, through the placement contract only."""
    out: dict[str, torch.Tensor] = {}
    for params, places in zip(per_rank, placements):
        for name, local in params.items():
            place = places[name]
            full = out.setdefault(place.name, torch.full(place.global_shape, float("nan")))
            flat, index = local.reshape(-1), 0
            for off, shape in place.boxes():
                n = math.prod(shape)
                full[tuple(slice(o, o + s) for o, s in zip(off, shape))] = flat[index: index + n].view(shape)
                index += n
    return out


def overlapped_gather(overrides: list[str], out: str) -> dict:
    """ZeRO-1/2 with every bucket in 4 segments: one step, then what the next forward waits for."""
    from threefold.parallel import zero
    from threefold.train.trainer import Trainer

    zero.SEGMENT_MIN_BYTES = 0
    trainer = Trainer(make_config(overrides, out))
    trainer.train_one_step()
    sync = trainer.parallel.grad_sync
    due_after_step = sync._gather_due
    in_flight = []  # segments whose all-gather has not been waited for when a module's forward begins
    names = {id(m): n for n, m in trainer.parallel.module.named_modules()}
    for name, module in trainer.parallel.module.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            module.register_forward_pre_hook(lambda m, a: in_flight.append((names[id(m)], len(sync._gathers))))
    trainer.train_one_step()
    records = trainer.run()  # to the configured steps; the parameters are whole when it returns
    return {"due_after_step": due_after_step, "in_flight": in_flight, "segments": [len(s) for s in sync.segments],
            "left": len(sync._gathers), "loss": records[-1]["loss"]}


def zero3_gathers_in_place(overrides: list[str], out: str) -> dict:
    """ZeRO-3: every all-gather's outputs are the whole parameters' own storages, and no copy
    writes into a whole parameter (counted by a dispatch mode over the whole run)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    sync, comm = trainer.parallel.grad_sync, trainer.comm
    fulls = [sp.full for unit in sync.units for sp in unit.params]
    outputs, foreign = [], []
    gather_many = comm.all_gather_many

    def spy(outs, ins, axis, lane=""):
        storages = {p.untyped_storage().data_ptr(): p for p in fulls if p.untyped_storage().nbytes()}
        for o in outs:
            p = storages.get(o.untyped_storage().data_ptr())
            outputs.append(p is not None and p.data_ptr() == o.data_ptr())
        return gather_many(outs, ins, axis, lane)

    comm.all_gather_many = spy

    class CopiesIntoWeights(TorchDispatchMode):
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                target = args[0].untyped_storage()
                if target.nbytes() and any(p.untyped_storage().data_ptr() == target.data_ptr() for p in fulls):
                    CopiesIntoWeights.copies += 1
            return func(*args, **(kwargs or {}))

    with CopiesIntoWeights():
        records = trainer.run()
    return {"outputs": outputs, "copies": CopiesIntoWeights.copies, "loss": records[-1]["loss"]}


def pooled_buckets(overrides: list[str], out: str, steps: int = 3) -> dict:
    """Plain DP, then ZeRO-2 with the same overrides; per ZeRO-2 step, what its bucket pool allocated
    and which buffers the buckets filled."""
    from threefold.train.trainer import Trainer

    def params(trainer) -> dict:
        trainer.parallel.settle()
        return {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()}

    reference = Trainer(make_config(overrides + ["parallel.zero=0"], out + "/dp"))
    for _ in range(steps):
        reference.train_one_step()
    trainer = Trainer(make_config(overrides + ["parallel.zero=2"], out + "/zero2"))
    sync = trainer.parallel.grad_sync
    pool, pooled, filled = sync.pool, sync._pooled, []

    def spy(bucket):
        whole = pooled(bucket)
        filled[-1].add(whole.data_ptr())
        return whole

    sync._pooled = spy
    per_step = []
    for _ in range(steps):
        filled.append(set())
        before = pool.allocations
        record = trainer.train_one_step()
        per_step.append({"allocations": pool.allocations - before, "buffers": len(pool.buffers),
                         "filled": len(filled[-1]), "grads": record["mem"]["grads"]})
    return {"buckets": len(sync.buckets.buckets), "steps": per_step, "pool_size": pool.size,
            "shard_bytes": sum(s.numel() * s.element_size() for s in sync.grad_shards),
            "dp": params(reference), "zero2": params(trainer)}


def zero2_unused_parameter(micro: int = 2) -> dict:
    """ZeRO-2 (pooled buckets) and plain DP on the same batches, rank 1 never using the last block:
    this rank's reduced gradient shard, and the same range of plain DP's summed gradients."""
    from threefold.comm import Comm
    from threefold.mesh import Layout, Mesh
    from threefold.models.decoder import build_model
    from threefold.parallel.data import parallelize_data
    from threefold.parallel.zero import ZeroReducer

    mesh = Mesh(Layout(dp=2), torch.device("cpu"))
    comm = Comm(mesh)
    cfg = make_config(["model.preset=tiny"], "unused").model

    def train(make_sync):
        model = build_model(cfg, seed=0)
        sync = make_sync(model)
        sync.zero_grad()
        for i in range(micro):
            tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 * mesh.rank("dp") + i))
            with sync.micro_batch(last=i == micro - 1):
                x = model.embed(tokens)
                for block in model.blocks if mesh.rank("dp") == 0 else model.blocks[:-1]:
                    x = block(x)
                model.loss(model.head(model.norm(x)), tokens).backward()
        sync.finish()
        return model, sync

    dp_model, _ = train(lambda m: parallelize_data(m, comm, bucket_mb=0.01))
    reference = {name: p.grad for name, p in dp_model.named_parameters() if p.requires_grad}
    _, zero = train(lambda m: ZeroReducer(list(m.named_parameters()), comm, 2, bucket_mb=0.01))
    got, expected = [], []
    for b in zero.buckets.buckets:
        whole = torch.cat([reference[zero.names[id(p)]].reshape(-1) for p in b.params])
        whole = torch.cat([whole, whole.new_zeros(b.numel() - whole.numel())])
        expected.append(torch.cat([whole[lo:hi] for lo, hi, _ in zero.owned(b)]))
        got.append(zero.grad_shards[b.index].clone())
    return {"got": torch.cat(got), "expected": torch.cat(expected), "buckets": len(zero.buckets.buckets),
            "pool": len(zero.pool.buffers)}


def zero3_lanes(runs: list[list[str]], out: str) -> list[dict]:
    """ZeRO-3, per override list: the group of every all-gather and reduce-scatter handed to
    torch.distributed (the dp group, the dp `gather` lane, or another), and the lanes Comm's records name."""
    import torch.distributed as dist

    from threefold.comm import collectives
    from threefold.mesh import GATHER
    from threefold.train.trainer import Trainer

    reports = []
    for overrides in runs:
        trainer = Trainer(make_config(overrides, out))
        mesh = trainer.mesh
        names = {id(mesh.group("dp")): "dp", id(mesh.group("dp", GATHER)): "gather"}
        calls: list[tuple[str, str]] = []
        originals = {"_all_gather": collectives._all_gather, "_reduce_scatter": collectives._reduce_scatter}

        def spying(op: str, fn):
            def call(*args, group=None, **kwargs):
                calls.append((op, names.get(id(group), "other")))
                return fn(*args, group=group, **kwargs)
            return call

        for attr, fn in originals.items():
            setattr(collectives, attr, spying(attr.strip("_"), fn))
        try:
            records = trainer.run()
        finally:
            for attr, fn in originals.items():
                setattr(collectives, attr, fn)
        reports.append({"calls": calls, "records": [(r.op, r.axis, r.lane) for r in trainer.comm.records],
                        "lane_ranks": dist.get_process_group_ranks(mesh.group("dp", GATHER)), "dp_ranks": mesh.ranks("dp"),
                        "loss": records[-1]["loss"]})
        del trainer
    return reports


def nvme_parity(base: list[str], out: str) -> dict:
    """ZeRO-1 and ZeRO-3, 10 steps saving at 5 and 10: without offload, with parallel.offload=nvme,
    the nvme run resumed from its step 5, and that checkpoint resumed without offload."""
    from pathlib import Path

    from threefold.checkpoint.format import step_dir_name
    from threefold.train.trainer import Trainer

    scratch = Path(out) / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    nvme = ["parallel.offload=nvme", f"parallel.offload_dir={scratch}", "parallel.offload_block_mb=0.05",
            "parallel.offload_prefetch=1"]
    report: dict = {}
    for stage in (1, 3):
        common = base + [f"parallel.zero={stage}", "train.steps=10", "checkpoint.save_every=5"]
        first = Path(out) / f"z{stage}-nvme" / "checkpoints" / step_dir_name(5)
        for run, extra in (("none", []), ("nvme", nvme), ("resumed", nvme + [f"checkpoint.resume={first}"]),
                           ("resumed-none", [f"checkpoint.resume={first}"])):
            trainer = Trainer(make_config(common + extra, str(Path(out) / f"z{stage}-{run}")))
            records = trainer.run()
            trainer.parallel.settle()  # nvme under ZeRO-3: the run ends with the shards in their file
            entry = {"losses": [r["loss"] for r in records],
                     "params": {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()}}
            if run == "nvme":
                opt = trainer.optimizer
                entry["units"] = len(opt.units)
                entry["file"] = opt.path.exists() and opt.path.stat().st_size == opt.nbytes
                entry["scratch_metric"] = records[-1]["mem"].get("scratch") == opt.scratch_nbytes > 0
                paths, home = [opt.path], None
                if opt.home is not None:  # ZeRO-3: the parameter shards in a scratch file of their own
                    home = opt.home
                    entry["home"] = {"units": len(home.shards), "peak": home.peak_resident,
                                     "read": home.stats.read_bytes, "size": home.file_bytes(),
                                     "nbytes": home.nbytes, "unlinked": not home.path.exists()}
                    g = opt.grads
                    entry["grads"] = {"read": g.stats.read_bytes, "written": g.stats.write_bytes, "nbytes": g.nbytes,
                                      "resident": len(g.resident), "unlinked": not g.path.exists()}
            report[f"z{stage}-{run}"] = entry
            del trainer, records
        opt = home = None  # the last references: the optimizer's finalizers remove the files
        import gc

        gc.collect()
        report[f"z{stage}-left"] = [str(p) for p in paths if p.exists()]
    return report
