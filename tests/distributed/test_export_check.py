"""`ckpt export --hf` proves itself by logits (checkpoint/logit_check.py): for every family the project
exports - the reference decoder as a Llama and as a GPT-2, and the `hf:DIR` families of
config/families.py (Llama, Mistral, Qwen2, Qwen3, GPT-2, Mixtral, Qwen2-MoE, Qwen3-MoE) - a checkpoint
trained one step is exported and transformers' logits of the export match threefold's forward of
the checkpoint within the fp32 bound. Exporting with the rotary row permutation dropped fails the
check, naming the worst position, and removes the export. A `hf:DIR` start prints its own check before
step 1 (threefold's reader and forward against transformers' forward of the directory)."""

import contextlib
import io

import pytest

pytest.importorskip("transformers")

from tests.hf_moe_tasks import save_tiny_moe  # noqa: E402
from tests.hf_tasks import save_tiny  # noqa: E402
from tests.helpers import make_config  # noqa: E402
from threefold.checkpoint.format import CheckpointError  # noqa: E402
from threefold.checkpoint.hf import export_hf  # noqa: E402
from threefold.checkpoint.logit_check import BOUNDS, check_export  # noqa: E402
from threefold.config.families import FAMILIES  # noqa: E402

TRAIN = ["train.steps=1", "checkpoint.save_every=1", "train.global_batch=2", "train.seq_len=16"]
DENSE = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")


def train_each(cases: list[tuple[list[str], str]]) -> list[str]:
    """One step and a checkpoint of each case, one after the other in this process; their stderr."""
    from threefold.train.trainer import Trainer

    errs = []
    for overrides, out in cases:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            Trainer(make_config(overrides, out)).run()
        errs.append(err.getvalue())
    return errs


@pytest.fixture(scope="module")
def runs(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("export-check")
    models = {"reference-llama": ["model.preset=tiny-llama"], "reference-gpt2": ["model.preset=tiny"],
              # a padded vocabulary (250 -> 256 rows): the export writes the real rows, the check compares them
              "reference-padded": ["model.preset=tiny-llama", "model.vocab=250", "model.vocab_multiple=64"]}
    for family in DENSE:
        models[family] = [f"model.preset=hf:{save_tiny(family, root / family)}"]
    for family in MOE:
        models[family] = [f"model.preset=hf:{save_tiny_moe(family, root / family)}"]
    (errs,) = worlds(1).run(train_each, [([*preset, *TRAIN], str(root / f"run-{name}")) for name, preset in
                                         models.items()])
    return root, list(models), dict(zip(models, errs))


def test_every_family_supported_is_covered():
    assert {f.model_type for f in FAMILIES.values()} == set(DENSE) | set(MOE)


def test_export_prints_its_logit_check_for_every_family(runs):
    root, names, _ = runs
    lines = {}
    for name in names:
        export_hf(root / f"run-{name}", root / f"hf-{name}")
        check = check_export(root / f"run-{name}", root / f"hf-{name}")
        assert check is not None and check.ok and check.max_rel <= BOUNDS["float32"], (name, check)
        lines[name] = check.line()
        assert lines[name].startswith("export check: logits match transformers, max relative error "), lines[name]
        assert lines[name].endswith("over 4x16 tokens (bound 1e-05, float32)"), lines[name]
    print("\n".join(f"{name}: {line}" for name, line in lines.items()))


def test_bf16_check_holds_its_bound(runs):
    root, _, _ = runs
    export_hf(root / "run-reference-llama", root / "hf-bf16")
    check = check_export(root / "run-reference-llama", root / "hf-bf16", dtype="bfloat16")
    assert check.ok and 0 < check.max_rel <= BOUNDS["bfloat16"], check


def test_an_export_without_the_rotary_permutation_fails_and_is_removed(runs, monkeypatch):
    from threefold.models import reference_hf

    root, _, _ = runs
    monkeypatch.setattr(reference_hf, "rope_pairs_to_halves", lambda t, head_dim: t.clone())  # the bug put in
    out = root / "hf-broken"
    export_hf(root / "run-reference-llama", out)
    with pytest.raises(CheckpointError) as failed:
        check_export(root / "run-reference-llama", out)
    message = str(failed.value)
    assert message.startswith("export check FAILED: logits differ from transformers at sequence "), message
    assert "> bound 1e-05 (float32, 4x16 tokens)" in message and f"removed {out}" in message, message
    assert not out.exists()


def test_a_hugging_face_start_prints_its_check_before_step_1(runs):
    _, names, errs = runs
    for name in names:
        lines = [line for line in errs[name].splitlines() if "init check" in line]
        if name.startswith("reference"):  # initialised from the seed: nothing to compare
            assert lines == [], (name, errs[name])
            continue
        assert len(lines) == 1 and lines[0].startswith("threefold: init check: logits match transformers, max "
                                                       "relative error "), (name, errs[name])
