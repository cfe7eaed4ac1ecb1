"""The multi-tensor optimizer (foreach on CPU, fused on CUDA) keeps "same bits under any
sharding": 20 steps under ZeRO-0 (whole parameters) and ZeRO-3 (flat shards) end bitwise equal, in fp32
and in bf16 (whose masters ZeRO-3 starts from the fp32 values of its own chunks, built unit by unit)."""

from pathlib import Path

import pytest

from tests.helpers import make_config

BASE = ["model.preset=tiny", "model.layers=2", "train.global_batch=4", "train.seq_len=16", "train.lr=1e-3",
        "train.steps=20", "debug.dump_params=true",
        "train.grad_clip=0"]  # the clipping factor comes from a norm summed in another order per layout


def _train(overrides: list[str], out: str) -> None:
    from threefold.train.trainer import Trainer

    Trainer(make_config(overrides, out)).run()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_multi_tensor_adamw_gives_the_same_bits_under_zero0_and_zero3(worlds, tmp_path, precision):
    import torch

    from threefold.observe.params import load_global

    params = {}
    for zero in (0, 3):
        out = tmp_path / f"zero{zero}"
        worlds(2).run(_train, BASE + [f"parallel.zero={zero}", f"precision.compute={precision}"], str(out))
        params[zero] = load_global(Path(out) / "params")
    assert params[0].keys() == params[3].keys()
    for name, value in params[0].items():
        assert torch.equal(value, params[3][name]), name


def test_fused_adamw_kernel_is_blind_to_the_partition():
    """The CUDA path's kernel (fused), on CPU: pieces of a tensor step to the bits of the whole."""
    import torch

    def run(cuts):
        torch.manual_seed(0)
        whole, grads = torch.randn(1000), [torch.randn(1000) for _ in range(5)]
        bounds = [0, *cuts, 1000]
        pieces = [torch.nn.Parameter(whole[a:b].clone()) for a, b in zip(bounds, bounds[1:])]
        opt = torch.optim.AdamW(pieces, lr=1e-2, weight_decay=0.1, fused=True)
        for g in grads:
            for piece, (a, b) in zip(pieces, zip(bounds, bounds[1:])):
                piece.grad = g[a:b].clone()
            opt.step()
        return torch.cat([p.detach() for p in pieces])

    assert torch.equal(run([]), run([3, 17, 501, 502, 777]))
