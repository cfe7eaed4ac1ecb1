"""`threefold.prepare` on three plain PyTorch models (batch norm; nn.TransformerEncoder; frozen, shared and
unused parameters) under dp, ZeRO-1 and ZeRO-3 on 2 and 4 gloo ranks, against the user's own loop
(torch.optim.AdamW): loss and every parameter and buffer within 1e-5 over 6 steps; a resume at step 3
equal bitwise to the uninterrupted run; the gradient bytes exactly those of the trainable parameters."""

import pytest
import torch

from tests.engine_tasks import SAVED, reference, resume, run
from tests.helpers import rel_err
from tests.zero_tasks import assemble
from threefold.comm import ring_chunk

MODELS = ["ConvBN", "ViT", "FrozenShared"]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_engine_matches_plain_loop(worlds, tmp_path, name, n):
    ref = reference(name, n if name == "ConvBN" else 1)  # batch norm: each rank normalises its own share
    runs = [[f"parallel.zero={zero}"] for zero in (0, 1, 3)]
    if name == "ViT" and n == 2:  # accumulation and activation checkpointing by class under ZeRO-3 (and ZeRO-2)
        runs += [["parallel.zero=3", "train.microbatches=2", "remat.policy=full"],
                 ["parallel.zero=2", "train.microbatches=2"]]
    for overrides in runs:
        zero = int(overrides[0][-1])
        ckpt = str(tmp_path / f"ckpt{len(overrides)}{zero}") if n == 2 and zero in (1, 3) else None
        reports = worlds(n).run(run, name, overrides, ckpt)
        got = assemble([r["tensors"] for r in reports], [r["placements"] for r in reports])
        assert got.keys() == ref["tensors"].keys() - {"b.weight"}  # the shared weight once, as a.weight
        for key, want in ref["tensors"].items():
            if key in got and want.is_floating_point():
                err = rel_err(got[key], want.detach())
                assert err <= 1e-5, f"{name} n={n} zero={zero}: {key} differs from the plain loop by {err:.2e}"
        for a, b in zip(reports[0]["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (name, n, zero, reports[0]["losses"], ref["losses"])
        if ckpt is not None:  # resumed at step SAVED: bitwise the uninterrupted run
            assert reports[0]["resumed"] == reports[0]["losses"][SAVED:]
            for r in reports:
                for key, t in r["tensors"].items():
                    assert torch.equal(r["resumed_state"][key], t), f"{name} zero={zero}: {key} after resume"
        if overrides == ["parallel.zero=0"]:  # plain dp all-reduces the trainable parameters once each: frozen ones never travel
            from tests.engine_tasks import build

            g = sum(p.numel() for p in build(name).parameters() if p.requires_grad)
            for rank, r in enumerate(reports):
                for comm in r["comm"]:
                    assert comm["dp"]["all_reduce"] == 2 * (g - ring_chunk(g, n, rank)) * 4 or \
                        _bucketed(comm["dp"]["all_reduce"], g, n)


def _bucketed(nbytes: int, g: int, n: int) -> bool:
    """Several buckets: each all-reduce's ring chunk is its own; the total is between the bounds."""
    return 2 * (g - -(-g // n)) * 4 * 0.9 <= nbytes <= 2 * g * 4


def _matches(name: str, reports: list[dict], ref: dict, what: str) -> None:
    got = assemble([r["tensors"] for r in reports], [r["placements"] for r in reports])
    for key, want in ref["tensors"].items():
        if key in got and want.is_floating_point():
            err = rel_err(got[key], want.detach())
            assert err <= 1e-5, f"{what}: {key} differs from the plain loop by {err:.2e}"
    for a, b in zip(reports[0]["losses"], ref["losses"][-len(reports[0]["losses"]):]):
        assert abs(a - b) <= 1e-5 * abs(b), (what, reports[0]["losses"], ref["losses"])


def test_engine_tensor_parallel_by_plan_matches_plain_loop(worlds, tmp_path):
    """The ViT's MLPs split over tp by a plan dict (colwise linear1, rowwise linear2), alone and under
    dp + ZeRO-1 / ZeRO-3; its step-3 checkpoint (tp = 2) resumed bitwise at tp = 2 and, within 1e-5
    of the plain loop, at dp = 2 (tp = 1)."""
    ref = reference("ViT", 1)
    ckpt = str(tmp_path / "tp2")
    for n, overrides in ((2, ["parallel.tp=2"]), (4, ["parallel.tp=2", "parallel.zero=1"]),
                         (4, ["parallel.tp=2", "parallel.zero=3", "parallel.dp=2"])):
        reports = worlds(n).run(run, "ViT", overrides, ckpt if n == 2 else None)
        _matches("ViT", reports, ref, f"n={n} {overrides}")
        place = reports[0]["placements"]["encoder.layers.0.linear1.weight"]
        assert place.global_shape == (32, 16) and place.shape == (16, 16), place  # half the hidden features
        assert all(sum(c["tp"].values()) > 0 for r in reports for c in r["comm"]), "the plan's collectives"
        if n == 2:
            assert reports[0]["resumed"] == reports[0]["losses"][SAVED:]
    resumed = worlds(2).run(resume, "ViT", ["parallel.zero=1"], ckpt)
    _matches("ViT", resumed, ref, "tp=2 checkpoint resumed at dp=2")
    assert resumed[0]["eval"] == resumed[1]["eval"]


def test_engine_options_on_a_plain_module(worlds):
    """The ViT at dp = 2 under optimizer offload and compile (aot_eager) within 1e-5 of the plain loop;
    a bf16 gradient wire halves the dp bytes of the fp32 run and bf16 compute follows the loop's losses
    within 3e-2."""
    ref = reference("ViT", 1)
    for overrides in (["parallel.zero=1", "parallel.offload=optimizer"],
                      ["train.compile=true", "debug.compile_backend=aot_eager"]):
        reports = worlds(2).run(run, "ViT", overrides)
        _matches("ViT", reports, ref, str(overrides))
        assert (reports[0]["graphs"] > 0) == ("train.compile=true" in overrides), reports[0]["graphs"]
    dense = worlds(2).run(run, "ViT", ["parallel.zero=0"])[0]
    for overrides, tol in ((["compress.method=bf16"], 1e-2), (["precision.compute=bf16"], 3e-2)):
        got = worlds(2).run(run, "ViT", overrides)[0]
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= tol * abs(b), (overrides, got["losses"], ref["losses"])
        if overrides == ["compress.method=bf16"]:
            wire = [c["dp"]["all_reduce"] for c in got["comm"]]
            assert wire == [c["dp"]["all_reduce"] // 2 for c in dense["comm"]], (wire, dense["comm"][0]["dp"])


def test_engine_takes_a_peft_lora_config(worlds):
    """prepare(..., lora=LoraConfig) trains peft's own LoRA model: against peft's model in the plain loop
    within 1e-5 (adapters and frozen base) under dp = 2 and ZeRO-3; the optimizer holds only the
    adapters' states (fp32 compute: the parameter is its own master, AdamW's 2 fp32 moments = 8 bytes
    per element of this rank's share)."""
    pytest.importorskip("peft")
    from tests.engine_tasks import run_lora

    ref = reference("ViT", 1, lora=True)
    adapters = 2 * 4 * ((16 + 32) + (32 + 16))  # 2 layers x r (in + out) of linear1 and linear2
    for zero in (0, 3):
        reports = worlds(2).run(run_lora, "ViT", [f"parallel.zero={zero}"])
        _matches("ViT+lora", reports, ref, f"lora zero={zero}")
        for r in reports:
            if zero == 0:
                assert r["trainable"] == adapters
            assert all("lora_" in name for name in r["updated"]), r["updated"]
            assert r["optimizer_bytes"] == 8 * (adapters if zero == 0 else adapters // 2), r["optimizer_bytes"]


def test_refusals(worlds):
    from threefold.errors import ConfigError

    import threefold
    from tests.engine_tasks import build
    for bad, key, plan in ((["parallel.tp=2"], "parallel.tp", None), (["remat.policy=selective"], "remat.policy", None),
                           (["parallel.pp=2"], "parallel.pp", None), (["parallel.cp=2"], "parallel.cp", None),
                           (["debug.nan_check=true"], "debug.nan_check", None),
                           (["checkpoint.save_every=5"], "checkpoint.save_every", None),
                           ([], "plan", {"encoder.layers.*.linear1": "columnwise"}),
                           ([], "plan", {"encoder.nothing.*": "colwise"})):
        with pytest.raises(ConfigError, match=key):
            threefold.prepare(build("ViT"), torch.nn.CrossEntropyLoss(), bad, plan=plan)
    with pytest.raises(ConfigError, match="lora"):
        threefold.prepare(build("ViT"), torch.nn.CrossEntropyLoss(), lora={"r": 4})
