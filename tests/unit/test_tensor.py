"""Tensor parallelism in one process: plan application, placements, errors, the loss's math.

A stub mesh stands in for the tp axis: building the shards needs only the rank and the size,
and with tp = 1 every collective of `Comm` is a no-op.
"""

import pytest
import torch
import torch.nn.functional as F

from threefold.comm import Comm
from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.models.decoder import build_model
from threefold.models.decoder_plan import decoder_plan
from threefold.parallel.tensor import padded_size, vocab_parallel_cross_entropy
from threefold.parallel.tensor_plan import TensorPlanError, parallelize_tensor


class StubMesh:
    """Coordinates of one rank on a tp axis, without a process group (nothing communicates here)."""

    def __init__(self, tp: int, rank: int):
        self.tp, self.tp_rank = tp, rank
        self.device = torch.device("cpu")

    def size(self, axis):
        return self.tp if axis == "tp" else 1

    def rank(self, axis):
        return self.tp_rank if axis == "tp" else 0


def _model_cfg(*overrides):
    return load_config(None, list(overrides)).model


def _shard(cfg, tp, rank, sp=False):
    mesh = StubMesh(tp, rank)
    model = build_model(cfg, 0)
    return model, parallelize_tensor(model, mesh, Comm(mesh), decoder_plan(cfg), sp)


def test_shards_are_slices_of_the_single_device_weights():
    cfg = _model_cfg("model.preset=tiny", "model.vocab=255")
    full = dict(build_model(cfg, 0).named_parameters())
    for rank in range(2):
        model, placements = _shard(cfg, 2, rank)
        assert model.head.weight is model.embed.tok.weight  # tied weights stay tied
        assert "head.weight" not in placements
        for name, p in model.named_parameters():
            place = placements[name]
            assert place.name == name and place.global_shape == tuple(full[name].shape)
            assert tuple(p.shape) == place.shape
            for offsets, shape in place.boxes():
                want = full[name][tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
                local = p[tuple(slice(o - lo, o - lo + s) for o, lo, s in zip(offsets, place.offsets, shape))]
                assert torch.equal(local, want), name
        tok = placements["embed.tok.weight"]
        assert tok.shape == (128, 32) and tok.offsets == (128 * rank, 0) and "tp" not in tok.replicated_over
        if rank == 1:  # 255 rows padded to 256: the last row is padding, zero and never saved
            assert tok.boxes() == [((128, 0), (127, 32))]
            assert torch.equal(model.embed.tok.weight[-1], torch.zeros(32))
        assert placements["blocks.0.attn.o.weight"].offsets == (0, 16 * rank)
        assert placements["blocks.0.attn_norm.weight"].replicated_over == ("tp",)
        assert placements["blocks.0.attn.o.bias"].replicated_over == ("tp",)


def test_grouped_kv_heads_split_or_replicated():
    cfg = _model_cfg("model.preset=tiny-llama")  # 4 heads, 2 kv heads, head_dim 8
    model, placements = _shard(cfg, 2, 1)
    assert placements["blocks.0.attn.k.weight"].offsets == (8, 0)  # kv head 1 of 2
    for rank in range(4):
        model, placements = _shard(cfg, 4, rank)
        k = model.blocks[0].attn.k
        assert placements["blocks.0.attn.k.weight"].replicated_over == ("tp",)
        assert k.rows == ((rank // 2) * 8, 8)  # q heads {rank} belong to kv head rank // 2
        assert tuple(model.blocks[0].attn.q.weight.shape) == (8, 32)


@pytest.mark.parametrize("overrides,match", [
    (["model.heads=4", "model.kv_heads=4"], r"4 attention heads \(model.heads=4\) cannot be split over parallel.tp=3"),
    (["model.heads=6", "model.kv_heads=6", "model.hidden=48", "model.ffn_hidden=128"], "128 MLP features"),
])
def test_unsplittable_sizes_name_the_constraint(overrides, match):
    cfg = _model_cfg("model.preset=tiny", *overrides)
    with pytest.raises(TensorPlanError, match=match):
        _shard(cfg, 3, 0)


def test_kv_heads_neither_split_nor_replicable():
    cfg = _model_cfg("model.preset=tiny-llama", "model.heads=6", "model.kv_heads=3", "model.hidden=48",
                     "model.ffn_hidden=96")
    with pytest.raises(TensorPlanError, match="3 key/value heads"):
        _shard(cfg, 2, 0)


@pytest.mark.parametrize("overrides,field,match", [
    (["parallel.tp=3", "parallel.dp=1"], "parallel.tp", "model.heads=4 attention heads"),
    (["model.preset=tiny-llama", "model.heads=8", "model.kv_heads=8", "model.hidden=64", "parallel.tp=2",
      "model.ffn_hidden=97"], "parallel.tp", "model.ffn_hidden=97"),
    (["model.preset=tiny-llama", "model.heads=6", "model.kv_heads=3", "model.hidden=48", "model.ffn_hidden=96",
      "parallel.tp=2"], "parallel.tp", "model.kv_heads=3"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=31"], "train.seq_len", "divisible"),
])
def test_config_rejects_unsplittable_layouts(overrides, field, match):
    cfg = load_config(None, overrides)
    world = cfg.parallel.tp * max(1, cfg.parallel.dp)
    with pytest.raises(ConfigError, match=match) as info:
        cfg.validate(world)
    assert info.value.field == field


def test_config_accepts_padded_vocab_and_replicated_kv():
    load_config(None, ["model.vocab=255", "parallel.tp=4", "parallel.sequence_parallel=true"]).validate(4)
    load_config(None, ["model.preset=tiny-llama", "parallel.tp=4"]).validate(4)  # 2 kv heads replicated


def test_vocab_parallel_loss_ignores_padding_and_matches_cross_entropy():
    mesh = StubMesh(1, 0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, padded_size(10, 4), generator=gen)
    logits[:, 10:] = 50.0  # padding columns: large logits that must not count
    targets = torch.randint(0, 10, (12,), generator=gen)
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, targets, Comm(mesh), start=0, vocab=10)
    loss.sum().backward()
    y = logits[:, :10].clone().requires_grad_()
    ref = F.cross_entropy(y, targets, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad[:, :10], y.grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(x.grad[:, 10:], torch.zeros(12, 2))


class _LoggedGather:
    """A stand-in for `Comm` on a tp axis of 2 whose all-gather logs when it is issued and when it is
    waited for (both ranks' shards taken equal; a reduce-scatter keeps rank 0's chunk of the sum of
    two equal inputs): what the order of a backward's work is checked by."""

    def __init__(self, log):
        self.mesh, self.log = StubMesh(2, 0), log

    def reduce_scatter(self, out, inp, axis, async_op=False):
        self.log.append("reduce_scatter")
        out.copy_(2 * inp.chunk(2)[0])

    def all_gather(self, out, inp, axis, async_op=False, tag=""):
        self.log.append(f"all_gather.{tag}")
        out.copy_(torch.cat([inp, inp]))
        log = self.log

        class Handle:
            def wait(self):
                log.append("wait")
        if async_op:
            return Handle()
        log.append("wait")


def _matmul_logger(log: list[str]):
    """A TorchDispatchMode class that appends "mm" to `log` for every matmul run under it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "bmm", "addmm"):
                log.append("mm")
            return func(*args, **(kwargs or {}))
    return Matmuls


@pytest.mark.parametrize("fp8", [False, True])
def test_sequence_parallel_regather_runs_under_the_input_gradient_matmul(fp8):
    """The column-parallel linear saves its region's sequence shard; its backward issues the shard's
    all-gather, computes the input's gradient (which needs only the weight) while it is in flight,
    and waits for it before the weight's gradient (which needs the gathered input), as Megatron-LM
    overlaps them. The gradients are those of the plain linear on the gathered input."""
    from threefold.parallel.sequence_region import _LinearOnShard, _Regather

    log: list[str] = []
    Matmuls = _matmul_logger(log)

    gen = torch.Generator().manual_seed(0)
    shard = torch.randn(2, 3, 8, generator=gen)
    full = torch.cat([shard, shard], 1).requires_grad_()
    weight = torch.randn(5, 8, generator=gen, requires_grad=True)
    regather = _Regather(_LoggedGather(log), 1, shard)
    if fp8:
        from threefold.parallel.fp8 import Fp8Kernel, Fp8Recipe
        kernel = Fp8Kernel(Fp8Recipe.named("tensorwise"), emulate=True)
        y = kernel(full, weight, None, (shard, regather))
    else:
        y = _LinearOnShard.apply(full, shard, weight, None, regather)
    dy = torch.randn(y.shape, generator=gen)
    with Matmuls():
        y.backward(dy)
    matmuls = [i for i, e in enumerate(log) if e == "mm"]
    issued, waited = log.index("all_gather.sp_regather"), log.index("wait")
    assert issued < matmuls[0] < waited < matmuls[-1], log  # issued, input gradient, wait, weight gradient
    assert regather.full is None  # the one consumer let the gathered tensor go
    if not fp8:
        ref_x, ref_w = full.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        F.linear(ref_x, ref_w).backward(dy)
        assert torch.equal(full.grad, ref_x.grad) and torch.equal(weight.grad, ref_w.grad)


def test_sequence_parallel_regather_starts_with_the_regions_backward():
    """Under SP the row-parallel linear marks the region's output: the regather is issued as soon as
    the region's backward starts, before any of its matmuls (the down projection's, the activation's,
    the up projection's input gradient), and waited for only by the up projection's weight gradient.
    A region whose shard was not kept (a checkpointed region) issues it from its consumer instead."""
    from threefold.parallel.sequence_region import SequenceRegion
    from threefold.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    log: list[str] = []
    Matmuls = _matmul_logger(log)

    comm = _LoggedGather(log)
    gen = torch.Generator().manual_seed(0)
    region = SequenceRegion(comm, 1)
    up = ColumnParallelLinear(torch.randn(6, 8, generator=gen).requires_grad_(), None, comm)
    down = RowParallelLinear(torch.randn(8, 6, generator=gen).requires_grad_(), None, comm, sequence_parallel=True)
    up.region = down.region = region

    def mlp(x_shard):
        full = region.enter(x_shard)
        y = down(F.gelu(up(full)))
        region.leave()
        return y

    def mlp_of_intermediate(x):  # the region's input made inside, as a norm's output is
        return mlp(x * 1.0)

    x = torch.randn(2, 3, 8, generator=gen, requires_grad=True)
    dy = torch.randn(2, 3, 8, generator=gen)
    y = mlp_of_intermediate(x)
    log.clear()
    with Matmuls():
        y.backward(dy)
    gathers = [i for i, e in enumerate(log) if e == "all_gather.sp_regather"]
    matmuls = [i for i, e in enumerate(log) if e == "mm"]
    assert len(gathers) == 1 and gathers[0] < matmuls[0], log  # issued before the region's first matmul
    assert log.index("wait", gathers[0]) > matmuls[-2], log  # waited for by the last (weight-gradient) matmul
    grads = [x.grad.clone(), up.weight.grad.clone(), down.weight.grad.clone()]
    # a checkpointed region keeps no shard: the consumer issues the regather under its input gradient
    for t in (x, up.weight, down.weight):
        t.grad = None
    y = torch.utils.checkpoint.checkpoint(mlp_of_intermediate, x, use_reentrant=False)
    log.clear()
    with Matmuls():
        y.backward(dy)
    gathers = [i for i, e in enumerate(log) if e == "all_gather.sp_regather"]
    matmuls = [i for i, e in enumerate(log) if e == "mm"]
    assert len(gathers) == 1 and matmuls[0] < gathers[0] < log.index("wait", gathers[0]) < matmuls[-1], log
    assert all(torch.equal(a, b) for a, b in zip(grads, [x.grad, up.weight.grad, down.weight.grad]))
