"""`ckpt verify` (and every verification: resume, export) refuses a checkpoint holding a NaN or an
infinity, naming the tensor, its key and the element; a finite one still verifies."""

import torch

from tests.checkpoint_layouts import save_synthetic
from tests.unit.test_checkpoint_slices import full_tensors, layout
from threefold.checkpoint.verify import check_finite, slices_by_file, verify
from threefold.checkpoint.format import read_manifest
from threefold.cli import main


def test_verify_refuses_a_planted_nan_naming_the_tensor(tmp_path, capsys):
    fulls = full_tensors()
    fulls["w3"][1, 2, 6] = float("nan")  # in w3's second tp shard (columns 4..7 of dim 2)
    ckpt = save_synthetic(tmp_path / "checkpoints", 2, layout("tp2-dp1"), fulls)
    manifest, problems = verify(ckpt)
    assert len(problems) == 1, problems
    assert "tensor w3 is not finite: nan at [1, 2, 6] (key 'w3@0,0,4')" in problems[0]
    assert problems[0].startswith(str(ckpt / "rank-00001.safetensors"))
    assert main(["ckpt", "verify", str(ckpt)]) == 1
    assert "is not finite: nan" in capsys.readouterr().err


def test_an_infinity_in_a_low_precision_tensor_is_found_chunk_by_chunk(tmp_path):
    fulls = {name: t.to(torch.bfloat16) for name, t in full_tensors().items()}
    fulls["embed"][9, 5] = float("-inf")
    ckpt = save_synthetic(tmp_path / "checkpoints", 1, layout("single"), fulls)
    manifest = read_manifest(ckpt)
    held = slices_by_file(manifest)["rank-00000.safetensors"]
    problem = check_finite(ckpt / "rank-00000.safetensors", held, chunk=7)  # several chunks per tensor
    assert "tensor embed is not finite: -inf at [9, 5] (key 'embed@0,0')" in problem


def test_a_finite_checkpoint_verifies(tmp_path):
    ckpt = save_synthetic(tmp_path / "checkpoints", 2, layout("tp2-dp1"), full_tensors())
    assert verify(ckpt)[1] == []


def test_finite_values_whose_sum_overflows_are_not_reported(tmp_path):
    fulls = full_tensors()
    fulls["w3"].fill_(3e38)  # finite, but any two of them sum to inf: the sum's shortcut must not report them
    ckpt = save_synthetic(tmp_path / "checkpoints", 1, layout("single"), fulls)
    assert verify(ckpt)[1] == []
