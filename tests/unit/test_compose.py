"""One composition root (parallel/compose.py) over typed steps, and one registry of data-parallel sync kinds
(parallel/sync_kinds.py): every ZeRO stage and the periodic form of dp is an entry; the `ParallelModel` is
built once, complete (no attribute set on it afterwards anywhere in parallel/); a user's module composed
in one process gets each kind's sync, placements and settle hook."""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from threefold.parallel.compose import Build, compose
from threefold.parallel.model import ParallelModel
from threefold.parallel.sync_kinds import SYNC_KINDS, kind_name, wire_dtype

PARALLEL = Path(__file__).resolve().parents[2] / "src" / "threefold" / "parallel"


def test_every_stage_is_one_sync_kind():
    assert [kind_name(z) for z in range(4)] == ["dp", "zero1", "zero2", "zero3"]
    assert kind_name(0, periodic=True) == "periodic"
    assert set(SYNC_KINDS) == {"dp", "periodic", "zero1", "zero2", "zero3"}
    assert all(kind.name == name for name, kind in SYNC_KINDS.items())
    # ZeRO's only compression is a 16-bit wire; plain dp keeps mixed precision's (its hook compresses)
    assert wire_dtype(1, "bf16", torch.float32) == torch.bfloat16
    assert wire_dtype(0, "bf16", torch.float32) == torch.float32
    assert wire_dtype(3, "dgc", torch.bfloat16) == torch.bfloat16


def test_compose_runs_the_steps_in_order_over_one_build():
    seen = []
    build = compose([lambda b: seen.append(("a", b.zero)), lambda b: setattr(b, "zero", 2),
                     lambda b: seen.append(("c", b.zero))], Build(mesh=None, comm=None))
    assert seen == [("a", 0), ("c", 2)] and build.zero == 2


def test_parallel_model_is_never_patched_after_it_is_built():
    """No `x.<field> = ...` on a ParallelModel field outside its own methods (`self`), in any file of parallel/."""
    fields = {f.name for f in dataclasses.fields(ParallelModel)}
    patched = []
    for path in sorted(PARALLEL.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if (isinstance(t, ast.Attribute) and t.attr in fields and isinstance(t.value, ast.Name)
                        and t.value.id not in ("self", "b", "build")):
                    patched.append(f"{path.name}:{node.lineno} {t.value.id}.{t.attr}")
    assert patched == []


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_module_composed_with_each_sync_kind(alone, zero):
    from threefold.comm.collectives import Comm
    from threefold.config import Config, with_overrides
    from threefold.mesh import Layout, Mesh, init_distributed
    from threefold.parallel import parallelize_module
    from threefold.parallel.data import DataParallelReducer
    from threefold.parallel.zero import ZeroReducer
    from threefold.parallel.zero3 import Zero3

    if not torch.distributed.is_initialized():
        init_distributed(torch.device("cpu"))
    comm = Comm(Mesh(Layout(), torch.device("cpu")))
    cfg = with_overrides(Config(), parallel={"zero": zero}, remat={"policy": "full"})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = [q.detach().clone() for q in model.parameters()]
    parallel = parallelize_module(model, comm.mesh, comm, cfg, lambda m, x: m(x).square().sum())
    kind = {0: DataParallelReducer, 1: ZeroReducer, 2: ZeroReducer, 3: Zero3}[zero]
    assert type(parallel.grad_sync) is kind
    assert (parallel.settle_weights is not None) == (zero in (1, 2))  # set by the kind, at the build
    assert parallel.after_step is None if zero in (0, 3) else parallel.after_step is not None
    assert parallel.remat_regions == ["0", "2"]  # the default units: the items of the Sequential with parameters
    assert parallel.replica_axis == "dp" and parallel.comm is comm
    pieces = {p.name: p for p in parallel.pieces}  # in the kind's order (ZeRO-1/2: its buckets')
    assert sorted(pieces) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name, want in zip(["0.weight", "0.bias", "2.weight", "2.bias"], reference):  # one rank: whole parameters
        assert torch.equal(pieces[name].model[: want.numel()], want.view(-1))
