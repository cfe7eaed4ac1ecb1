"""Hugging Face mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) built with `transformers` from
small configs and saved with save_pretrained (nothing downloaded), trained by threefold under dp,
tp, expert parallelism and ZeRO-1, and compared with the library model's own single-process
training loop (plain torch AdamW, the load-balancing loss of the library per sequence)."""

import pytest
import torch

from tests.helpers import rel_err

pytest.importorskip("transformers")

from tests.hf_moe_tasks import TRAIN, reference_moe_training, save_tiny_moe, train_moe_many  # noqa: E402

TOKENS = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe")
    return {f: save_tiny_moe(f, root / f) for f in ("mixtral", "qwen2_moe", "qwen3_moe")}


def _check(result: dict, reference: dict, what: str, steps: slice = slice(None)) -> None:
    ref_losses = reference["losses"][steps]
    losses = [abs(a - b) / abs(b) for a, b in zip(result["losses"], ref_losses)]
    assert len(losses) == len(ref_losses) and max(losses) <= 1e-5, f"{what}: losses differ by {max(losses):.2e}"
    ref = reference["params"]
    assert result["params"].keys() == ref.keys(), f"{what}: parameters {set(result['params']) ^ set(ref)}"
    worst = max((rel_err(p, ref[n]), n) for n, p in result["params"].items())
    assert worst[0] <= 1e-5, f"{what}: {worst[1]} differs by {worst[0]:.2e}"


def _check_metrics(result: dict, reference: dict, what: str) -> None:
    for step, (got, want) in enumerate(zip(result["moe"], reference["moe"])):
        counts = got["tokens_per_expert"]
        assert (counts["min"], counts["max"]) == (want["min"], want["max"]), f"{what} step {step}: {counts} {want}"
        assert abs(counts["mean"] - want["mean"]) <= 1e-9 and got["dropped"] == 0, f"{what} step {step}"
        assert abs(got["aux_loss"] - want["aux_loss"]) <= 1e-5 * want["aux_loss"], \
            f"{what} step {step}: aux_loss {got['aux_loss']} against {want['aux_loss']}"


def test_hf_moe_layouts_match_the_transformers_training_loop(worlds, moe_dirs, tmp_path):
    """Mixtral under (dp 4, ep 2) with ZeRO-1 and (dp 2, tp 2, ep 2); Qwen2-MoE (a dense and a sparse
    layer, gated shared expert) under (dp 2, tp 2) with ZeRO-1; Qwen3-MoE (q/k norms) under (dp 4, ep 4)
    with full activation checkpointing. Loss, every parameter and the `moe` metrics."""
    layouts = {"mixtral dp4 ep2 ZeRO-1": ("mixtral", ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1"]),
               "mixtral dp2 tp2 ep2": ("mixtral", ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2"]),
               "qwen2_moe dp2 tp2 ZeRO-1": ("qwen2_moe", ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1"]),
               "qwen3_moe dp4 ep4 remat": ("qwen3_moe", ["parallel.dp=4", "parallel.ep=4", "remat.policy=full"])}
    bases = {f: [f"model.preset=hf:{d}", *TRAIN] for f, d in moe_dirs.items()}
    references = {f: reference_moe_training(moe_dirs[f], bases[f]) for f in moe_dirs}
    for f, ref in references.items():  # the loop trained, and the auxiliary loss is part of it
        assert max(rel_err(ref["params"][n], ref["initial"][n]) for n in ref["params"]) > 1e-3, f
        assert ref["moe"][0]["aux_loss"] > 1e-3, f
    runs = [(bases[f] + o, str(tmp_path / str(i))) for i, (f, o) in enumerate(layouts.values())]
    for rank_results in worlds(4).run(train_moe_many, runs, TOKENS):
        for (what, (family, _)), result in zip(layouts.items(), rank_results):
            _check(result, references[family], what)
            _check_metrics(result, references[family], what)


def test_hf_moe_saved_under_ep2_resumes_under_ep1_and_exports_to_transformers(worlds, moe_dirs, tmp_path):
    """Mixtral trained under (dp 4, ep 2), saved at step 3: resumed under ep 1 it ends as the library
    loop does; its --hf export stores the experts one by one as save_pretrained does, and
    from_pretrained gives the trained model's logits."""
    import transformers
    from safetensors import safe_open

    from threefold.checkpoint.hf import export_hf

    directory = moe_dirs["mixtral"]
    base = [f"model.preset=hf:{directory}", *TRAIN]
    reference = reference_moe_training(directory, base)
    saved = str(tmp_path / "ep2")
    runs = [(base + ["parallel.dp=4", "parallel.ep=2", "checkpoint.save_every=3"], saved),
            (base + ["parallel.dp=4", f"checkpoint.resume={tmp_path / 'ep2' / 'checkpoints' / 'step-00000003'}"],
             str(tmp_path / "ep1"))]
    results = worlds(4).run(train_moe_many, runs, TOKENS)
    for ep2, ep1 in results:
        _check(ep2, reference, "mixtral dp4 ep2")
        _check(ep1, reference, "mixtral resumed under ep1", slice(3, None))
    export_hf(tmp_path / "ep2", tmp_path / "hf")
    keys = lambda d: set(safe_open(str(d / "model.safetensors"), "pt").keys())  # noqa: E731
    assert keys(tmp_path / "hf") == keys(directory)  # the library's own layout: experts.<e>.w1/w2/w3
    library = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        logits = library(input_ids=TOKENS).logits
    errors = [rel_err(logits, r[0]["after"]) for r in results]
    assert max(errors) <= 1e-5, f"exported logits differ by {errors}"
    assert rel_err(logits, transformers.AutoModelForCausalLM.from_pretrained(str(directory))(
        input_ids=TOKENS).logits.detach()) > 1e-3  # training changed the model


def test_hf_moe_config_fields_and_refusals(moe_dirs, tmp_path):
    """config.json's experts become the model.* fields (so ep, pp and sequence parallelism are checked as
    for the reference decoder); what the adapter does not build is refused with one line."""
    import json

    from threefold.errors import ConfigError
    from threefold.config.hf import model_fields
    from tests.helpers import make_config

    mixtral, qwen2 = model_fields(moe_dirs["mixtral"]), model_fields(moe_dirs["qwen2_moe"])
    keys = ("experts", "experts_top_k", "expert_ffn_hidden", "moe_every", "router_aux_weight", "router_z_weight",
            "expert_capacity")
    assert tuple(mixtral[k] for k in keys) == (4, 2, 48, 1, 0.02, 0.0, 0.0)
    qwen2_keys = ("moe_every", "moe_start", "shared_experts", "expert_ffn_hidden")
    assert tuple(qwen2[k] for k in qwen2_keys) == (2, 1, 2, 24)
    base = [f"model.preset=hf:{moe_dirs['mixtral']}", *TRAIN]
    with pytest.raises(ConfigError, match="parallel.pp.*mixture of experts"):
        make_config(base + ["parallel.pp=2"], str(tmp_path / "pp")).validate(2)
    with pytest.raises(ConfigError, match="parallel.ep.*not divisible"):
        make_config(base + ["parallel.dp=3", "parallel.ep=3"], str(tmp_path / "ep")).validate(3)
    raw = json.loads((moe_dirs["qwen2_moe"] / "config.json").read_text())
    for change, message in (({"mlp_only_layers": [0]}, "mlp_only_layers=\\[0\\] is not supported"),
                            ({"hidden_act": "gelu"}, "hidden_act=gelu is not supported"),
                            ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported")):
        bad = tmp_path / next(iter(change))
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(ConfigError, match=f"model.preset: .*config.json: {message}"):
            make_config([f"model.preset=hf:{bad}", *TRAIN], str(tmp_path / "x"))
