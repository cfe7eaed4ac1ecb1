"""A config.json is what it claims: architectures agree with model_type (or come from it), and the
dropout it asks for is named once and written as trained (0) on export."""

import json

import pytest

pytest.importorskip("transformers")

from tests.hf_tasks import save_tiny  # noqa: E402
from threefold.errors import UserError  # noqa: E402
from threefold.config.hf import read_config_json  # noqa: E402


def _edit(directory, **changes):
    raw = json.loads((directory / "config.json").read_text())
    raw.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del raw[key]
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def test_architectures_that_contradict_model_type_are_refused(tmp_path):
    directory = _edit(save_tiny("llama", tmp_path / "m"), model_type="gemma")
    with pytest.raises(UserError) as e:
        read_config_json(directory)
    assert "architectures=LlamaForCausalLM but model_type=gemma" in str(e.value) and "\n" not in str(e.value)


def test_without_architectures_the_model_type_decides(tmp_path):
    from threefold.models.registry import hf_spec

    directory = _edit(save_tiny("qwen2", tmp_path / "m"), architectures=None)
    assert read_config_json(directory)["architectures"] == ["Qwen2ForCausalLM"]
    assert hf_spec(directory, seed=0).family == "Qwen2ForCausalLM"
    with pytest.raises(UserError, match="model_type=gemma is not supported"):
        read_config_json(_edit(directory, model_type="gemma"))


def test_dropout_is_named_and_exported_as_trained(tmp_path):
    from tests.helpers import make_config
    from threefold.models.registry import hf_spec
    from threefold.train.inputs import warnings_for

    directory = save_tiny("gpt2", tmp_path / "g", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    (warning,) = [w for w in warnings_for(make_config([f"model.preset=hf:{directory}"], "unused").validate(1))
                  if "dropout" in w]
    assert "resid_pdrop=0.1" in warning and "without dropout" in warning
    spec = hf_spec(directory, seed=0)
    assert all(spec.hf.config[k] == 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
    model = spec.build()
    assert all(m.p == 0.0 for m in model.modules() if type(m).__name__ == "Dropout")
