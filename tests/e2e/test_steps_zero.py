"""`train --steps 0` saves the model it starts from as the step-0 checkpoint: its Hugging Face export
is bitwise the weights the run was given."""

from safetensors.torch import load_file

from tests.e2e.cli import threefold
from tests.hf_tasks import save_tiny
from threefold.cli import main


def test_steps_zero_exports_the_initial_weights_bitwise(tmp_path, capsys):
    source = save_tiny("llama", tmp_path / "llama")
    run = threefold("train", "--model", f"hf:{source}", "--steps", "0", "--out", str(tmp_path / "run"),
                    "--seq-len", "16", "--no-progress")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-00000000").is_dir()
    capsys.readouterr()
    assert main(["ckpt", "export", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    want, got = load_file(source / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].equal(tensor), name
