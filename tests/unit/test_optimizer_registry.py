"""The optimizer registry (optim/registry.py): one entry per optimizer, the one dispatch on
train.optimizer; its bytes per parameter (the planner's), Muon's refusals, and the whole-matrix
exchange on one process."""

import subprocess
import sys
import typing

import pytest
import torch

from threefold.config import TrainConfig, load_config
from threefold.errors import ConfigError
from threefold.optim.exchange import MatrixExchange
from threefold.optim.muon import hidden_matrix
from threefold.optim.registry import ENTRIES, entry, optimizer_bytes
from threefold.planner.memory import bytes_per_param
from threefold.sharding import Placement


def test_every_optimizer_a_user_can_name_has_an_entry_and_makes_its_torch_optimizer():
    names = typing.get_args(typing.get_type_hints(TrainConfig)["optimizer"])
    assert set(names) <= set(ENTRIES) and set(ENTRIES) - set(names) == {"onebit_adam"}
    w = torch.nn.Parameter(torch.zeros(3, 3))
    cfg = TrainConfig()
    made = entry("adamw").make([{"params": [w]}], cfg, False, None)
    assert isinstance(made.optimizer, torch.optim.AdamW) and made.kinds(w) == ("exp_avg", "exp_avg_sq")
    made = entry("sgd").make([{"params": [w]}], TrainConfig(optimizer="sgd", momentum=0.0), False, None)
    assert isinstance(made.optimizer, torch.optim.SGD) and made.kinds(w) == ()
    assert [e.name for e in ENTRIES.values() if e.whole_matrices] == ["muon"]
    with pytest.raises(ValueError, match="muon needs whole matrices"):
        entry("muon").make([{"params": [w]}], TrainConfig(optimizer="muon"), False, None)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        entry("lion")


def test_bytes_per_parameter_come_from_the_entries():
    # docs/zero.md's table: AdamW 8 state bytes (+ fp32 master under 16-bit), SGD 4, Muon 4 on hidden matrices
    assert bytes_per_param("fp32") == (4, 4, 8) and bytes_per_param("bf16") == (2, 2, 12)
    assert bytes_per_param("bf16", "muon") == (2, 2, 8) and bytes_per_param("fp32", "sgd") == (4, 4, 4)
    muon = TrainConfig(optimizer="muon")
    assert optimizer_bytes(muon, "fp32", matrix_fraction=0.75) == 0.75 * 4 + 0.25 * 8
    code = "import sys, threefold.optim.registry, threefold.planner.memory; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_muon_takes_hidden_matrices_and_leaves_embeddings_and_head_to_adamw():
    assert hidden_matrix("blocks.0.attn.q.weight", (32, 32)) and hidden_matrix("model.layers.1.mlp.up_proj.weight", (8, 4))
    for name in ("embed.tok.weight", "lm_head.weight", "head.weight", "transformer.wte.weight", "model.embed_tokens.weight"):
        assert not hidden_matrix(name, (10, 4)), name
    assert not hidden_matrix("blocks.0.attn.q.bias", (32,))


@pytest.mark.parametrize("override,key", [("parallel.cp=2", "parallel.cp"), ("parallel.offload=optimizer", "parallel.offload"),
                                          ("train.sync_every=2", "train.sync_every"),
                                          ("compress.method=powersgd", "compress.method")])
def test_muon_refuses_what_it_does_not_serve_in_one_line(override, key):
    extra = ["parallel.zero=1"] if "offload" in override else []
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.preset=tiny", "train.optimizer=muon", override, *extra]).validate(2)
    assert str(e.value).startswith(f"{key}: train.optimizer=muon: ") and "\n" not in str(e.value)


def test_the_exchange_on_one_process_applies_fn_to_each_whole_matrix_once():
    places = [Placement.whole("a.weight", (4, 6)), Placement.whole("b.weight", (8, 8))]
    updates = [torch.randn(24), torch.randn(64)]
    seen = []
    out = MatrixExchange(places).orthogonalise(updates, lambda g: seen.append(tuple(g.shape)) or g * 2)
    assert seen == [(8, 8), (4, 6)]  # largest first, each once
    assert all(torch.equal(o, 2 * u) for o, u in zip(out, updates))
