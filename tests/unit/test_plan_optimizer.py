"""`threefold plan --optimizer NAME` (planner/optimizer.py): states from the optimizer registry, Muon's
Newton-Schulz work and whole-matrix exchange as threefold's runtime spreads them.

The references: the registry's entries (no second table), the real model's parameters (which are hidden
matrices), torch's FLOP counter over the runtime's own Newton-Schulz, and the bytes the Muon parity tests
count on the runtime's `Comm` (tests/distributed/test_muon.py asserts HIDDEN x ELT for its layouts).
"""

import json

import pytest

from tests.distributed.test_muon import BASE, ELT, HIDDEN
from tests.helpers import make_config
from threefold.cli import main
from threefold.config import TrainConfig, load_config
from threefold.optim.registry import ENTRIES, entry
from threefold.planner import optimizer as plan_optimizer
from threefold.planner.hardware import CPU, PRESETS
from threefold.planner.memory import stage_memory
from threefold.planner.optimizer import exchange_bytes, hidden_matrices, newton_schulz_flops, ns_ops
from threefold.planner.step_time import step_time
from threefold.planner.workload import Strategy, Workload, from_config, rank_chunks, rank_parameters

H100 = PRESETS["h100-80gb"]


def tiny(optimizer: str, **model) -> Workload:
    cfg = load_config(None, ["model.preset=tiny", "model.layers=2", *[f"model.{k}={v}" for k, v in model.items()]])
    return Workload(cfg.model, 8, 16, optimizer=optimizer)


def test_hidden_matrices_are_the_models_own():
    """The planner's list against the reference decoder's parameters that optim/muon.py gives Muon."""
    from threefold.models.decoder import build_model
    from threefold.optim.muon import hidden_matrix

    for mlp in ("gelu", "swiglu"):
        cfg = load_config(None, ["model.preset=tiny", "model.layers=2", f"model.mlp={mlp}"])
        real = {n: tuple(p.shape) for n, p in build_model(cfg.model, 0).named_parameters() if hidden_matrix(n, p.shape)}
        assert dict(hidden_matrices(cfg.model, range(2))) == real


def test_newton_schulz_flops_are_what_torch_counts_in_the_runtimes_iteration():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from threefold.optim.muon_step import newton_schulz

    for shape in ((32, 128), (128, 32), (48, 48)):
        with FlopCounterMode(display=False) as counter:
            newton_schulz(torch.randn(shape), 5)
        m, n = min(shape), max(shape)
        assert counter.get_total_flops() == newton_schulz_flops(shape, 5) == 5 * (2 * m * m * n + 2 * m ** 3 + 2 * m * m * n)


@pytest.mark.parametrize("optimizer", sorted(ENTRIES))
def test_memory_states_come_from_the_registry(optimizer):
    """Per rank under dp2 ZeRO-1 on the CPU (fp32): every trainable parameter's states from its entry, hidden
    matrices apart under a whole-matrix optimizer; parameters and gradients as AdamW's."""
    w, st = tiny(optimizer), Strategy(dp=2, zero=1, precision="fp32")
    e, cfg = entry(optimizer), TrainConfig(optimizer=optimizer)
    trainable = rank_parameters(w.model, 1, 1, 0).trainable
    matrix = HIDDEN if e.whole_matrices else 0
    expected = (matrix * e.bytes_per_param(cfg, "fp32", True)[2]
                + (trainable - matrix) * e.bytes_per_param(cfg, "fp32", False)[2]) / 2
    mem, adamw = stage_memory(w, st, 0, CPU), stage_memory(tiny("adamw"), st, 0, CPU)
    assert mem.optimizer == expected
    assert (mem.params, mem.grads) == (adamw.params, adamw.grads)
    if optimizer == "muon":  # momentum (4) on the 24,576 matrix elements, AdamW's 8 on the rest
        assert mem.optimizer == (HIDDEN * 4 + (trainable - HIDDEN) * 8) / 2 < adamw.optimizer


@pytest.mark.parametrize("layout, expected", [(["parallel.dp=2"], HIDDEN * ELT), (["parallel.tp=2"], HIDDEN * ELT),
                                              (["parallel.dp=2", "parallel.zero=3"], HIDDEN * ELT),
                                              (["parallel.pp=2"], 0)])
def test_exchange_bytes_are_the_runtimes_count(layout, expected, tmp_path):
    """The Muon parity test's model and layouts (tests/distributed/test_muon.py), read through `from_config`:
    the bytes its runs count on `Comm` per step, summed over every rank."""
    w, st = from_config(make_config(BASE + layout, str(tmp_path)), 2, "cpu")
    assert w.optimizer == "muon"  # train.optimizer, read by from_config (what predict_memory plans)
    stages = [tuple(i for c in rank_chunks(w.model, st.pp, s) for i in c.layers) for s in range(st.pp)]
    assert sum(exchange_bytes(hidden_matrices(w.model, b), st.dp, st.tp, st.zero) for b in stages) == expected
    # (2,2,2) ZeRO-1 with even ranges: per stage tp's 2 N (tp-1)/tp + ZeRO's 2 N (dp-1)/dp = 2 N, fp32
    assert exchange_bytes(hidden_matrices(w.model, range(2)), 2, 2, 1) == 2 * HIDDEN * ELT


def test_muon_step_time_on_h100_dp2():
    """tiny, 2 blocks, dp2 plain: 12 matrices owned 6 and 6 (sorted by size then name, k-th on dp coordinate k mod 2:
    an MLP pair and 4 attention matrices each, 12,288 elements); the only hop is the scatter, each rank sending its
    results (12,288 fp32) to the other and receiving as many, on NVLink; Newton-Schulz of 6 small matrices sits on
    the dispatch floor (6 x (3 + 8 x 5 + 1) operators)."""
    w, st = tiny("muon"), Strategy(dp=2, microbatches=1)
    t, adamw = step_time(w, st, H100), step_time(tiny("adamw"), st, H100)
    nvlink = H100.intra_bytes_per_s * H100.link_efficiency
    assert t.optimizer_exchange_s == pytest.approx(H100.intra_latency_s + 4 * 12288 / nvlink, rel=1e-12)
    assert t.optimizer_exchange_bytes == 2 * 4 * 12288 == HIDDEN * ELT
    assert t.optimizer_newton_schulz_s == pytest.approx(6 * ns_ops(5) * H100.op_overhead_s, rel=1e-12)
    assert ns_ops(5) == 44
    assert t.total_s - adamw.total_s == pytest.approx(t.optimizer_s - adamw.optimizer_s, rel=1e-9)
    assert adamw.optimizer_newton_schulz_s == adamw.optimizer_exchange_s == 0.0


def test_adamw_update_keeps_its_32_bytes():
    assert plan_optimizer.update_bytes_per_param("adamw", False) == 32  # read master, m, v, grad; write master, m, v, copy
    assert plan_optimizer.update_bytes_per_param("sgd", False) == 24 and plan_optimizer.update_bytes_per_param("muon", True) == 48


def plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


LAYOUT = ["--model", "llama-7b", "--gpus", "16", "--global-batch", "64", "--dp", "16", "--tp", "1", "--pp", "1",
          "--zero", "1", "--microbatches", "4", "--activation-checkpointing", "full"]


def test_plan_json_names_the_optimizer_additively(capsys):
    code, out, _ = plan(capsys, *LAYOUT, "--json", "--optimizer", "muon")
    muon = json.loads(out)
    code, out, _ = plan(capsys, *LAYOUT, "--json")
    adamw = json.loads(out)
    assert muon["optimizer"]["name"] == "muon" and muon["optimizer"]["matrices"] == 32 * 7
    assert muon["optimizer"]["bytes_per_param"] == {"matrix": 8, "rest": 12}
    assert muon["optimizer"]["states"] == {"matrix": ["momentum_buffer"], "rest": ["exp_avg", "exp_avg_sq"]}
    step = muon["candidates"][0]["step_breakdown_s"]
    assert step["optimizer_exchange_bytes"] == muon["optimizer"]["exchange_bytes_per_step"] > 0
    assert step["optimizer_newton_schulz_s"] > 0 and step["optimizer_s"] > step["optimizer_newton_schulz_s"]
    assert "optimizer_newton_schulz_s" not in adamw["candidates"][0]["step_breakdown_s"]  # AdamW's keys as before
    assert adamw["optimizer"]["name"] == "adamw" and adamw["optimizer"]["bytes_per_param"] == {"matrix": 12, "rest": 12}
    assert muon["candidates"][0]["memory_bytes"]["optimizer"] < adamw["candidates"][0]["memory_bytes"]["optimizer"]


@pytest.mark.parametrize("argv, flag", [(["--model", "tiny-moe"], "model.experts"), (["--cp", "2"], "--cp"),
                                        (["--set", "model.lora_rank=4"], "model.lora_rank"),
                                        (["--schedule", "pipedream-2bw"], "--schedule")])
def test_what_muon_does_not_serve_is_refused_in_one_line(capsys, argv, flag):
    code, _, err = plan(capsys, "--gpus", "2", "--optimizer", "muon", *argv)
    assert code == 2 and flag in err and "muon" in err and len(err.strip().splitlines()) == 1


def test_muon_never_searches_context_parallelism(capsys):
    args = ["--model", "tiny", "--set", "model.max_seq=16384", "--seq-len", "16384", "--gpus", "4", "--global-batch", "4",
            "--json"]
    assert any(c.get("cp", 1) > 1 for c in json.loads(plan(capsys, *args)[1])["candidates"])
    assert all(c.get("cp", 1) == 1 for c in json.loads(plan(capsys, *args, "--optimizer", "muon")[1])["candidates"])


def test_plan_help_names_the_optimizers_and_mxfp8(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--optimizer {" + ",".join(ENTRIES) + "}" in text and "mxfp8" in text


def test_planning_muon_in_mxfp8_imports_no_torch():
    from tests.unit.test_cli_startup import modules_after

    assert "torch" not in modules_after(["plan", "--model", "tiny", "--gpus", "2", "--optimizer", "muon",
                                         "--precision", "mxfp8"])
