"""Context parallelism and packed rows on Hugging Face models (gloo, CPU): the library's decoder layers
attending through threefold's attention seam (models/hf_attention.py), the sequence zigzag-split over
cp ranks. Over 4 steps, per-step loss and gradient norm and every final parameter within relative 1e-5
(fp32) of one process (cp = 1):

    Llama     ring, allgather and ulysses at cp = 2, ring at cp = 4 and at (cp 2, tp 2, sequence
              parallel), packed rows (data.pack) by ring and ulysses at cp = 2; fp16 (loss scaling)
              by ring at cp = 2 against one process in fp16 (relative 1e-3 per loss, 5e-3 per
              parameter, as tests/distributed/test_composition.py's fp16 cases)
    GPT-2     ring and ulysses at cp = 2 (learned positions at the global zigzag index), packed rows
              by ring at cp = 2 (positions restarting per document) and at cp = 1
    Mixtral   ring at cp = 2 and at (dp 2, cp 2, ep 2): the load-balancing loss of whole sequences
              (its statistics summed over cp), also the `moe` metrics (tokens per expert, aux_loss)

and the one-process runs against the library itself: the unpacked runs' 6 losses and final parameters
(and Mixtral's metrics) against the library model's own training loop on the whole sequences, the
packed runs' first loss against the library model on each document alone. The weights are drawn with
initializer_range 0.1 so that attention is far from uniform and a wrong position or a skipped core
moves the first loss by about 1e-2."""

import random

import pytest
import torch

from tests.case_runs import assert_parameters_match, assert_steps_match, run_by_world_size
from tests.data_helpers import write_prepared
from tests.expert_tasks import train_many  # train_layout's results and the `moe` metrics of every step
from tests.helpers import rel_err

pytest.importorskip("transformers")

from tests.hf_moe_tasks import reference_moe_training, save_tiny_moe  # noqa: E402
from tests.hf_tasks import reference_training, save_tiny  # noqa: E402

STEPS = 4
TOL = 1e-5
FP16_TOL = (1e-3, 5e-3)  # loss, parameter: fp16 roundings in another order (tests/distributed/test_composition.py)
TRAIN = ["train.global_batch=4", "train.seq_len=32", "train.microbatches=2", "train.lr=1e-3", "train.eps=1e-6",
         "train.min_lr_ratio=1.0", f"train.steps={STEPS}"]
DATA = "data.source={prepared}"
MODELS = ("llama", "gpt2", "mixtral")
BASE, GPT2, MIXTRAL = ([f"model.preset=hf:{{{model}}}"] + TRAIN for model in MODELS)
PACKED, GPT2_PACKED = BASE + ["data.pack=true", DATA], GPT2 + ["data.pack=true", DATA]
FP16 = BASE + ["precision.compute=fp16"]


def _cases():
    """name -> (world size, overrides, reference overrides)."""
    cases = {f"cp2 {m}": (2, BASE + ["parallel.cp=2", f"parallel.cp_method={m}"], BASE)
             for m in ("ring", "allgather", "ulysses")}
    cases["cp4 ring"] = (4, BASE + ["parallel.cp=4"], BASE)
    # tp splits the heads (and, with sequence parallelism, the norms' sequence), cp the sequence (cp outer)
    cases["cp2 tp2 sp"] = (4, BASE + ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], BASE)
    for method in ("ring", "ulysses"):
        cases[f"packed cp2 {method}"] = (2, PACKED + ["parallel.cp=2", f"parallel.cp_method={method}"], PACKED)
    cases["cp2 ring fp16"] = (2, FP16 + ["parallel.cp=2"], FP16)
    for method in ("ring", "ulysses"):  # 4 heads: ulysses splits them over cp
        cases[f"gpt2 cp2 {method}"] = (2, GPT2 + ["parallel.cp=2", f"parallel.cp_method={method}"], GPT2)
    cases["gpt2 packed cp2 ring"] = (2, GPT2_PACKED + ["parallel.cp=2"], GPT2_PACKED)
    cases["mixtral cp2"] = (2, MIXTRAL + ["parallel.cp=2"], MIXTRAL)
    # expert parallelism over dp: the routed rows cross ep within each cp coordinate
    cases["mixtral dp2 cp2 ep2"] = (4, MIXTRAL + ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2"], MIXTRAL)
    return cases


CASES = _cases()
REFS = [tuple(BASE), tuple(PACKED), tuple(FP16), tuple(GPT2), tuple(GPT2_PACKED), tuple(MIXTRAL)]


@pytest.fixture(scope="module")
def runs(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("context_hf")
    dirs = {"llama": save_tiny("llama", root / "llama", initializer_range=0.1),  # attention far from uniform
            "gpt2": save_tiny("gpt2", root / "gpt2", initializer_range=0.1),
            "mixtral": save_tiny_moe("mixtral", root / "mixtral", initializer_range=0.1)}
    rng = random.Random(0)
    docs = [[rng.randrange(1, 250) for _ in range(rng.randrange(3, 17))] for _ in range(60)]
    prepared = write_prepared(root / "prepared", docs, vocab=250)

    def concrete(overrides):
        return [o.format(prepared=prepared, **dirs) for o in overrides]

    cases = {name: (n, concrete(ov), ref) for name, (n, ov, ref) in CASES.items()}
    out = run_by_world_size(worlds, train_many, cases, root)
    single = worlds(1).run(train_many, [(concrete(ref), str(root / f"ref{i}")) for i, ref in enumerate(REFS)])[0]
    out["refs"] = dict(zip(REFS, single))
    out["dirs"], out["prepared"], out["concrete"] = dirs, prepared, concrete
    return out


def _flat(metrics: dict) -> dict:
    """A step's `moe` metrics as the library loop's: tokens per expert (min, mean, max) and aux_loss."""
    return {**metrics["tokens_per_expert"], "aux_loss": metrics["aux_loss"]} if "tokens_per_expert" in metrics \
        else metrics


def _check_metrics(name: str, results: list[dict], ref: list[dict], tol: float = TOL) -> None:
    """Every rank's `moe` metrics of every step: the same tokens per expert, aux_loss within `tol`."""
    for r in results:
        assert len(r["moe"]) == len(ref) == STEPS
        for step, (got, want) in enumerate(zip(map(_flat, r["moe"]), map(_flat, ref)), 1):
            assert (got["min"], got["max"]) == (want["min"], want["max"]), f"{name} step {step}: {got} {want}"
            assert abs(got["mean"] - want["mean"]) <= 1e-9, f"{name} step {step}: {got} {want}"
            assert abs(got["aux_loss"] - want["aux_loss"]) <= tol * want["aux_loss"], \
                f"{name} rank {r['rank']} step {step}: aux_loss {got['aux_loss']} vs {want['aux_loss']}"


@pytest.mark.parametrize("name", list(CASES))
def test_hf_context_parallel_matches_one_process(runs, name):
    results, ref = runs[name], runs["refs"][tuple(CASES[name][2])]
    loss_tol, param_tol = FP16_TOL if name.endswith("fp16") else (TOL, TOL)
    assert_steps_match(name, results, ref, loss_tol, steps=STEPS)
    assert_parameters_match(name, results, ref, param_tol)
    if name.startswith("mixtral"):
        _check_metrics(name, results, ref["moe"])


def test_fp16_under_cp_scales_its_loss(runs):
    """The fp16 runs are fp16 runs: their first loss is the fp32 one's to fp16 rounding, not bitwise."""
    fp16, fp32 = runs["refs"][tuple(FP16)], runs["refs"][tuple(BASE)]
    assert fp16["losses"][0] != fp32["losses"][0]
    assert abs(fp16["losses"][0] - fp32["losses"][0]) <= 1e-2 * fp32["losses"][0]
    assert fp16["losses"][-1] < fp16["losses"][0]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_one_process_matches_the_library_training_loop(runs, model):
    """The cp = 1 run (the seam without a core: the library's SDPA path) against the library model's own
    loop on the whole sequences: every loss and every final parameter."""
    from threefold.models.hf_causal import HF_RENAMES
    from threefold.models.hf_gpt2 import HF_RENAMES as GPT2_RENAMES
    from threefold.models.spec import HFFormat

    base = {"llama": BASE, "gpt2": GPT2}[model]
    ref = runs["refs"][tuple(base)]
    library = reference_training(runs["dirs"][model], runs["concrete"](base))
    for step, (a, b) in enumerate(zip(ref["losses"], library["losses"]), 1):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs the library's {b}"
    key_of = HFFormat(GPT2_RENAMES if model == "gpt2" else HF_RENAMES).key_of
    assert len(ref["params"]) == len(library["params"])
    for name, p in ref["params"].items():
        assert rel_err(p, library["params"][key_of(name)]) <= TOL, f"{name} differs from the library's"


def test_mixtral_one_process_matches_the_library_training_loop(runs):
    """Mixtral's cp = 1 run against the library's loop (its load-balancing loss per sequence): every loss,
    every parameter, the tokens per expert and the aux_loss of every step."""
    ref = runs["refs"][tuple(MIXTRAL)]
    library = reference_moe_training(runs["dirs"]["mixtral"], runs["concrete"](MIXTRAL))
    assert library["moe"][0]["aux_loss"] > 1e-3  # the auxiliary loss is part of the loss
    for step, (a, b) in enumerate(zip(ref["losses"], library["losses"]), 1):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs the library's {b}"
    assert ref["params"].keys() == library["params"].keys()
    for name, p in ref["params"].items():
        assert rel_err(p, library["params"][name]) <= TOL, f"{name} differs from the library's"
    _check_metrics("mixtral cp1", [ref], library["moe"])


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_packed_first_step_is_the_library_model_on_each_document(runs, model):
    """Step 1's loss of the one-process packed run equals the mean token loss over every counted target
    of the batch computed by the library model on each document alone (positions from 0)."""
    import contextlib
    import io

    import torch.nn.functional as F
    import transformers

    from threefold.data.build import build_samplers

    from tests.helpers import make_config

    packed = {"llama": PACKED, "gpt2": GPT2_PACKED}[model]
    cfg = make_config(runs["concrete"](packed), "unused").validate(1)
    sampler, _ = build_samplers(cfg.data, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, cfg.model.vocab)
    with contextlib.redirect_stderr(io.StringIO()):
        library = transformers.AutoModelForCausalLM.from_pretrained(str(runs["dirs"][model]), dtype=torch.float32)
    batch = sampler.step_batch(0)
    total, count, documents = 0.0, 0, 0
    with torch.no_grad():
        for r in range(batch.inputs.shape[0]):
            ids, counted = batch.packing.documents[r], batch.packing.counted[r]
            for d in ids.unique().tolist():
                where = (ids == d) & counted
                if where.any():
                    inputs = batch.inputs[r][ids == d][: int(where.sum())][None]
                    logits = library(input_ids=inputs).logits[0]
                    total += float(F.cross_entropy(logits.float(), batch.targets[r][where], reduction="sum"))
                    count, documents = count + int(where.sum()), documents + 1
    assert documents >= 8  # rows of several documents
    ref = runs["refs"][tuple(packed)]["losses"][0]
    assert abs(ref - total / count) <= TOL * total / count, (ref, total / count)
