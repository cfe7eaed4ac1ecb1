"""`threefold plan` end to end: table, --json contract, --scaling PNG, one-line errors."""

import json

import pytest

from threefold.cli import main


def plan(capsys, *argv):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_prints_a_table_with_the_best_layout_and_reasons(capsys):
    code, out, _ = plan(capsys, "--model", "llama-70b", "--gpus", "16", "--gpu", "h100-80gb", "--global-batch", "16",
                        "--top", "8")
    assert code == 0
    assert "llama-70b: 69B parameters" in out and "16 x h100-80gb" in out
    assert "best: dp=" in out and "why the others lose:" in out
    assert "% slower" in out and "does not fit: needs" in out


def test_json_follows_the_contract(capsys):
    code, out, _ = plan(capsys, "--model", "llama-7b", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "16",
                        "--seq-len", "2048", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["model"]["params"] == 6_738_415_616
    assert doc["workload"] == {"global_batch": 16, "seq_len": 2048, "tokens_per_step": 16 * 2048, "assumed": "",
                                 "batch_raised": None}
    assert doc["checkpoint"]["every_steps"] >= 1 and 0 < doc["checkpoint"]["lost_fraction"] < 1
    cands = doc["candidates"]
    assert cands and cands[0]["fits"]
    for c in cands:
        assert {"dp", "tp", "pp", "zero", "microbatches", "activation_checkpointing", "fits", "step_time_s",
                "tokens_per_s", "mfu"} <= set(c)
        mem = c["memory_bytes"]
        assert mem["total"] >= mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]
        assert c["dp"] * c["tp"] * c["pp"] == 8
    speeds = [c["tokens_per_s"] for c in cands if c["fits"]]
    assert speeds == sorted(speeds, reverse=True)


def test_layout_options_evaluate_that_layout(capsys):
    code, out, _ = plan(capsys, "--model", "gpt3-175b", "--gpus", "384", "--gpu", "a100-80gb", "--tp", "8", "--pp",
                        "12", "--microbatches", "384", "--activation-checkpointing", "full", "--schedule", "1f1b",
                        "--zero", "0", "--global-batch", "1536", "--json")
    assert code == 0
    cands = json.loads(out)["candidates"]
    assert len(cands) == 1
    c = cands[0]
    assert (c["dp"], c["tp"], c["pp"], c["microbatches"], c["fits"]) == (4, 8, 12, 384, True)


def test_scaling_writes_a_png(capsys, tmp_path):
    png = tmp_path / "scaling.png"
    code, out, _ = plan(capsys, "--model", "tiny", "--gpus", "8", "--gpu", "h100-80gb", "--global-batch", "64",
                        "--scaling", str(png), "--scaling-max", "64", "--top", "2")
    assert code == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "scaling (same global batch):" in out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0] in {"8", "16", "32", "64"}]
    assert [int(r[0]) for r in rows] == [8, 16, 32, 64]


def test_a_model_that_fits_nowhere_exits_2_with_one_line(capsys):
    # on 4 GPUs not even its parameters and gradients fit (on 8, ZeRO-1 at one replica with host offload does)
    code, out, err = plan(capsys, "--model", "llama-70b", "--gpus", "4", "--gpu", "a100-40gb", "--global-batch", "16")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "fits no layout" in lines[0] and "short by" in lines[0]
    assert "at least 32 a100-40gb GPUs are needed" in lines[0]
    assert "no layout fits; the closest:" in out and "does not fit: needs" in out


@pytest.mark.parametrize("argv,fragment", [
    (["--gpu", "v100"], "unknown GPU kind"),
    (["--gpus", "8", "--dp", "3", "--tp", "2", "--pp", "1"], "dp x tp x pp = 6"),
    (["--seq-len", "9999"], "exceeds model.max_seq"),
    (["--set", "model.layers=x"], "model.layers"),
    (["--model", "gpt5"], "unknown preset"),
])
def test_bad_inputs_exit_2_with_one_line(capsys, argv, fragment):
    code, _, err = plan(capsys, "--model", "tiny", *argv) if "--model" not in argv else plan(capsys, *argv)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and fragment in err


def test_an_assumed_global_batch_is_stated(capsys):
    code, out, _ = plan(capsys, "--model", "tiny", "--gpus", "8", "--gpu", "h100-80gb", "--top", "3")
    assert code == 0
    # 2 sequences have a layout of 8 GPUs (dp 2, tp 2, pp 2): kept, not raised to one per GPU
    assert "assumed global batch 2 x 64 = 128 tokens per step (~149 tokens for 35.7k parameters); give --global-batch" \
           in out and "raised" not in out
    code, out, _ = plan(capsys, "--model", "tiny", "--gpus", "8", "--global-batch", "64", "--top", "2")
    assert code == 0 and "assumed" not in out


def test_best_plan_breakdown_checkpoint_advice_and_explain(capsys):
    code, out, _ = plan(capsys, "--model", "llama-7b", "--gpus", "16", "--gpu", "a100-80gb", "--global-batch", "256",
                        "--top", "3", "--mtbf-hours", "20000", "--save-seconds", "40",
                        "--explain", "dp=16 tp=1 pp=1 zero=0 ckpt=full")
    assert code == 0
    assert "  step " in out and " = compute " in out and "memory " in out
    assert "checkpoints (16 GPUs of MTBF 20,000 h each, save given): checkpoint every " in out
    explain = out[out.index("explain dp=16 tp=1 pp=1 zero=0"):]
    assert "ckpt=full" in explain and ("slower" in explain or "does not fit" in explain)
    assert "recomputation" in explain  # full recomputation shows up as its own term
    # negligible terms stay out of the why column (no "+4.83e-09 s")
    assert "e-0" not in out


def test_an_impossible_explicit_layout_says_why(capsys):
    code, out, err = plan(capsys, "--model", "llama-7b", "--gpus", "24", "--tp", "3", "--pp", "1", "--dp", "8")
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "tp=3 does not divide the 32 heads" in lines[0]


def test_the_efficiency_axis_fits_its_values():
    from threefold.planner.scaling import efficiency_axis_top

    assert 105 <= efficiency_axis_top([{"gpus": 8, "fits": True, "efficiency": 1.0, "mfu": 0.4}]) <= 110
    assert efficiency_axis_top([{"gpus": 8, "fits": True, "efficiency": 1.24, "mfu": 0.4},
                                {"gpus": 4, "fits": False}]) > 124


def test_expert_parallelism_and_a_slow_network_in_the_json(capsys):
    code, out, _ = plan(capsys, "--model", "tiny-moe", "--gpus", "8", "--global-batch", "64", "--seq-len", "64",
                        "--json", "--inter-gbps", "10")
    assert code == 0
    doc = json.loads(out)
    assert doc["model"]["experts"] == 4 and doc["model"]["active_params"] < doc["model"]["params"]
    assert {c["ep"] for c in doc["candidates"]} >= {1, 2, 4}
    assert "ep_comm_s" in doc["candidates"][0]["step_breakdown_s"]
    assert "slow_links" not in doc  # one node: no data-parallel group crosses the network
    code, out, _ = plan(capsys, "--model", "llama-7b", "--gpus", "32", "--global-batch", "256", "--inter-gbps", "10")
    assert code == 0 and "slow links:" in out and "would be" in out and "Loss risk: DiLoCo" in out
    assert main(["plan", "--model", "tiny", "--ep", "2"]) == 2
    assert "ep=2 needs a mixture of experts" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny", "--inter-gbps", "0"]) == 2
    assert "--inter-gbps" in capsys.readouterr().err
