"""`threefold train --model hf:DIR`, `threefold ckpt export CKPT --hf OUT`, `threefold plan --model hf:DIR`
on a small Llama saved with save_pretrained, and the mistakes a user can make with them."""

import json
import shutil

import pytest

from tests.e2e.cli import threefold

pytest.importorskip("transformers")

from tests.hf_tasks import save_tiny  # noqa: E402

QUICK = ["--steps", "2", "--global-batch", "4", "--seq-len", "16", "--no-progress"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")
    (directory / "tokenizer.json").write_text('{"model": "a stand-in tokenizer file"}')
    return directory


def test_train_export_and_plan_a_hugging_face_directory(llama, tmp_path, capsys):
    """The run needs its own processes (--nproc 2); export and plan run in this one through the same
    `main` (a child process each would add only the start-up of torch and transformers)."""
    import torch
    import transformers

    from threefold.cli import main

    run = threefold("train", "--model", f"hf:{llama}", "--nproc", "2", "--tp", "2", *QUICK, "--save-every", "2",
                    "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    capsys.readouterr()
    assert main(["ckpt", "export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "tokenizer.json").read_text() == (llama / "tokenizer.json").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    source = transformers.AutoModelForCausalLM.from_pretrained(str(llama))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, source.get_parameter(n))]
    assert "model.layers.0.self_attn.q_proj.weight" in changed  # trained weights, under the library's names
    capsys.readouterr()
    again = main(["ckpt", "export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")])
    assert again == 2 and "not empty" in capsys.readouterr().err  # never overwrites
    assert main(["plan", "--model", f"hf:{llama}", "--gpus", "8", "--seq-len", "16"]) == 0, capsys.readouterr().err
    parity = threefold("parity", "--model", f"hf:{llama}", "--layouts", "1,1,1 1,2,1", "--steps", "2",
                       "--global-batch", "4", "--seq-len", "16", "--out", str(tmp_path / "parity"), timeout=300)
    assert parity.returncode == 0 and "parity PASSED" in parity.stdout, parity.stdout[-2000:] + parity.stderr


def _broken(kind: str, llama, tmp_path):
    directory = tmp_path / kind
    shutil.copytree(llama, directory)
    config = json.loads((directory / "config.json").read_text())
    if kind == "no-config":
        (directory / "config.json").unlink()
    elif kind == "architecture":
        config["architectures"] = ["BertForMaskedLM"]
    elif kind == "shapes":
        config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config)) if kind != "no-config" else None
    return directory


@pytest.mark.parametrize("kind, args, message", [
    ("no-config", [], "no config.json; --model hf:DIR needs a Hugging Face model directory"),
    ("architecture", [], "architectures=BertForMaskedLM is not supported; supported: LlamaForCausalLM"),
    ("shapes", [], "model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64], config.json "
     "implies [96, 64]"),
    ("fine", ["--nproc", "3", "--tp", "3"], "model.heads=4 attention heads cannot be split over tp=3"),
])
def test_mistakes_with_a_model_directory_exit_2_with_one_line(llama, tmp_path, kind, args, message):
    directory = _broken(kind, llama, tmp_path)
    run = threefold("train", "--model", f"hf:{directory}", *QUICK, "--out", str(tmp_path / "run"), *args)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], run.stderr
