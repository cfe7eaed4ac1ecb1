"""Context parallelism and packed rows on a Hugging Face Llama (gloo, CPU): the library's decoder layers
attending through threefold's attention seam (models/hf_attention.py), the sequence zigzag-split over
cp ranks. Over 6 steps, per-step loss and gradient norm and every final parameter within relative 1e-5
(fp32) of one process (cp = 1) - ring, allgather and ulysses at cp = 2, ring at cp = 4 and at (cp 2,
tp 2, sequence parallel), packed rows (data.pack) by ring and ulysses at cp = 2 - and the one-process
runs against the library itself: the unpacked run's 6 losses and final parameters against the library
model's own training loop on the whole sequences, the packed run's first loss against the library
model on each document alone. The weights are drawn with initializer_range 0.1 so that attention is
far from uniform and a wrong position or a skipped core moves the first loss by about 1e-2."""

import random

import pytest
import torch

from tests.case_runs import assert_parameters_match, assert_steps_match, run_by_world_size
from tests.composition_tasks import train_many
from tests.data_helpers import write_prepared
from tests.helpers import rel_err

pytest.importorskip("transformers")

from tests.hf_tasks import reference_training, save_tiny  # noqa: E402

STEPS = 6
TOL = 1e-5
MODEL = "model.preset=hf:{llama}"
DATA = "data.source={prepared}"
BASE = [MODEL, "train.global_batch=4", "train.seq_len=32", "train.microbatches=2", "train.lr=1e-3",
        "train.eps=1e-6", "train.min_lr_ratio=1.0", f"train.steps={STEPS}"]
PACKED = BASE + ["data.pack=true", DATA]


def _cases():
    """name -> (world size, overrides, reference overrides)."""
    cases = {f"cp2 {m}": (2, BASE + ["parallel.cp=2", f"parallel.cp_method={m}"], BASE)
             for m in ("ring", "allgather", "ulysses")}
    cases["cp4 ring"] = (4, BASE + ["parallel.cp=4"], BASE)
    # tp splits the heads (and, with sequence parallelism, the norms' sequence), cp the sequence (cp outer)
    cases["cp2 tp2 sp"] = (4, BASE + ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], BASE)
    for method in ("ring", "ulysses"):
        cases[f"packed cp2 {method}"] = (2, PACKED + ["parallel.cp=2", f"parallel.cp_method={method}"], PACKED)
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def runs(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("context_hf")
    llama = save_tiny("llama", root / "llama", initializer_range=0.1)  # attention far from uniform
    rng = random.Random(0)
    docs = [[rng.randrange(1, 250) for _ in range(rng.randrange(3, 17))] for _ in range(60)]
    prepared = write_prepared(root / "prepared", docs, vocab=250)

    def concrete(overrides):
        return [o.format(llama=llama, prepared=prepared) for o in overrides]

    cases = {name: (n, concrete(ov), ref) for name, (n, ov, ref) in CASES.items()}
    out = run_by_world_size(worlds, train_many, cases, root)
    refs = [tuple(BASE), tuple(PACKED)]
    single = worlds(1).run(train_many, [(concrete(ref), str(root / f"ref{i}")) for i, ref in enumerate(refs)])[0]
    out["refs"] = dict(zip(refs, single))
    out["llama"], out["prepared"], out["concrete"] = llama, prepared, concrete
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_hf_context_parallel_matches_one_process(runs, name):
    results, ref = runs[name], runs["refs"][tuple(CASES[name][2])]
    assert_steps_match(name, results, ref, TOL, steps=STEPS)
    assert_parameters_match(name, results, ref, TOL)


def test_one_process_matches_the_library_training_loop(runs):
    """The cp = 1 run (the seam without a core: the library's SDPA path) against the library model's own
    loop on the whole sequences: every loss and every final parameter."""
    from threefold.models.hf_causal import HF_RENAMES
    from threefold.models.spec import HFFormat

    ref = runs["refs"][tuple(BASE)]
    library = reference_training(runs["llama"], runs["concrete"](BASE))
    for step, (a, b) in enumerate(zip(ref["losses"], library["losses"]), 1):
        assert abs(a - b) <= TOL * abs(b), f"step {step}: loss {a} vs the library's {b}"
    key_of = HFFormat(HF_RENAMES).key_of
    for name, p in ref["params"].items():
        assert rel_err(p, library["params"][key_of(name)]) <= TOL, f"{name} differs from the library's"


def test_packed_first_step_is_the_library_model_on_each_document(runs):
    """Step 1's loss of the one-process packed run equals the mean token loss over every counted target
    of the batch computed by the library model on each document alone (positions from 0)."""
    import contextlib
    import io

    import torch.nn.functional as F
    import transformers

    from threefold.data.build import build_samplers

    from tests.helpers import make_config

    cfg = make_config(runs["concrete"](PACKED), "unused").validate(1)
    sampler, _ = build_samplers(cfg.data, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, cfg.model.vocab)
    with contextlib.redirect_stderr(io.StringIO()):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(runs["llama"]), dtype=torch.float32)
    batch = sampler.step_batch(0)
    total, count, documents = 0.0, 0, 0
    with torch.no_grad():
        for r in range(batch.inputs.shape[0]):
            ids, counted = batch.packing.documents[r], batch.packing.counted[r]
            for d in ids.unique().tolist():
                where = (ids == d) & counted
                if where.any():
                    inputs = batch.inputs[r][ids == d][: int(where.sum())][None]
                    logits = model(input_ids=inputs).logits[0]
                    total += float(F.cross_entropy(logits.float(), batch.targets[r][where], reduction="sum"))
                    count, documents = count + int(where.sum()), documents + 1
    assert documents >= 8  # rows of several documents
    ref = runs["refs"][tuple(PACKED)]["losses"][0]
    assert abs(ref - total / count) <= TOL * total / count, (ref, total / count)
