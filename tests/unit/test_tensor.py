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
