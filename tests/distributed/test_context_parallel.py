"""Context parallelism wired into training (gloo, CPU): the sequence of every micro-batch zigzag-split
over cp ranks, attention by ring / allgather / ulysses, against one process over 4 steps - per-step
loss and gradient norm and every final parameter within relative 1e-5 - on the reference decoder's
Llama (RoPE at global positions) and GPT (learned positions at global positions) variants at
cp = 2 and 4, and cp = 2 with dp = 2, ZeRO-3, tp, pp, remat, compile, a mixture of experts (also
with ep = 2: the experts' gradients summed over edp and cp in one group, and with tp under sequence
parallelism: the routers' statistics summed over tp and cp). PipeDream-2BW (pp = 2, whose stale
weights differ from one process) against its own run at cp = 1 (`PEER_REFS`: 2 processes, in the
world of 2's call), itself checked to be the delayed update; a cp = 2 run's checkpoint of
step 2 resumed on one process (cp = 1) gives the one-process losses of steps 3-4 and final parameters. Each world
size runs all its cases in one call (tests/composition_tasks.py `train_many`)."""

import random

import pytest

from threefold.checkpoint.format import step_dir_name

from tests.case_runs import assert_parameters_match, assert_steps_match, case_dir, run_by_world_size
from tests.composition_tasks import train_many
from tests.data_helpers import write_prepared
from tests.helpers import rel_err

STEPS = 4
BASE = ["train.global_batch=4", "train.seq_len=16", "train.lr=1e-3", "train.eps=1e-6", f"train.steps={STEPS}",
        "train.microbatches=2"]
LLAMA = ["model.preset=tiny-llama"] + BASE
GPT = ["model.preset=tiny"] + BASE
TOL = 1e-5
BF16 = ["precision.compute=bf16"]
BF16_TOL = 2e-2  # bf16 roundings in another order (the attention's sums split over ranks)
DATA = "data.source={prepared}"  # a prepared directory with a validation split, written by the fixture
EVAL = ["train.eval_every=2", "train.eval_batches=2", DATA]
SAVED = 2  # the step whose checkpoint (written under cp = 2) resumes under cp = 1
DEEP = ["model.layers=2", "train.microbatches=4"]
TWO_BW = LLAMA + DEEP + ["parallel.pp=2", "pipeline.schedule=pipedream-2bw"]  # at cp = 1: a reference of 2 ranks
PEER_REFS = {tuple(TWO_BW): 2}  # reference overrides -> their world size (the others run on one process)


def _cases():
    """name -> (world size, overrides, reference overrides)."""
    cases = {}
    for model, base in (("llama", LLAMA), ("gpt", GPT)):
        for cp in (2, 4):
            for method in ("ring", "allgather", "ulysses"):
                # tiny-llama has 2 kv heads: ulysses at cp = 4 needs 4
                ref = base + (["model.kv_heads=4"] if model == "llama" and method == "ulysses" and cp == 4 else [])
                cases[f"{model} cp{cp} {method}"] = (cp, ref + [f"parallel.cp={cp}", f"parallel.cp_method={method}"],
                                                     ref)
    cases["llama dp2 cp2"] = (4, LLAMA + ["parallel.dp=2", "parallel.cp=2", "train.microbatches=1"], LLAMA)
    cases["llama cp2 zero3"] = (2, LLAMA + ["parallel.cp=2", "parallel.zero=3"], LLAMA)
    cases["llama cp2 saved"] = (2, LLAMA + ["parallel.cp=2", f"checkpoint.save_every={SAVED}"], LLAMA)
    # tp splits the heads, cp the sequence of each tp rank's heads (4 ranks: cp outer, tp inner)
    cases["llama cp2 tp2 ring"] = (4, LLAMA + ["parallel.cp=2", "parallel.tp=2"], LLAMA)
    cases["gpt cp2 tp2 ulysses"] = (4, GPT + ["parallel.cp=2", "parallel.tp=2", "parallel.cp_method=ulysses"], GPT)
    cases["llama cp2 tp2 sp allgather"] = (4, LLAMA + ["parallel.cp=2", "parallel.tp=2", "parallel.cp_method=allgather",
                                                       "parallel.sequence_parallel=true"], LLAMA)
    # pipeline stages each split the sequence of every micro-batch over their cp group
    for schedule, layers, extra in (("gpipe", 2, []), ("1f1b", 2, []), ("zb-h1", 2, []),
                                    ("interleaved", 4, ["pipeline.virtual_stages=2"]),
                                    ("zb-v", 4, []), ("dualpipev", 4, [])):  # 4 layers: two chunks per rank
        deep = [f"model.layers={layers}", "train.microbatches=4"]
        cases[f"llama cp2 pp2 {schedule}"] = (4, LLAMA + deep + extra + ["parallel.cp=2", "parallel.pp=2",
                                                                         f"pipeline.schedule={schedule}"], LLAMA + deep)
    # pipedream-2bw (no flush between steps): each stage's cp ranks split every micro-batch and reach
    # its update together; the same stale updates as at cp = 1
    cases["llama cp2 pp2 pipedream-2bw"] = (4, TWO_BW + ["parallel.cp=2"], TWO_BW)
    # evaluation splits its sequences as training does (EVAL: validation loss at steps 2 and 4)
    cases["llama cp2 eval"] = (2, LLAMA + EVAL + ["parallel.cp=2"], LLAMA + EVAL)
    cases["gpt cp2 pp2 eval"] = (4, GPT + EVAL + ["parallel.cp=2", "parallel.pp=2", "train.microbatches=2"],
                                 GPT + EVAL + ["train.microbatches=2"])
    # compiled blocks (aot_eager: no code generation) around the eager attention collectives
    cases["llama cp2 compile"] = (2, LLAMA + ["parallel.cp=2", "train.compile=true", "debug.compile_backend=aot_eager"],
                                  LLAMA)
    # activation checkpointing recomputes each block's forward, its ring transfers included
    cases["llama cp2 ring remat"] = (2, LLAMA + ["parallel.cp=2", "remat.policy=full"], LLAMA)
    cases["gpt cp2 allgather remat"] = (2, GPT + ["parallel.cp=2", "parallel.cp_method=allgather",
                                                  "remat.policy=selective"], GPT)
    # mixture of experts (dropless): the routers see this rank's zigzag part of each sequence, their
    # per-sequence statistics (balance and z-loss) summed over cp; the auxiliary loss counted once
    moe = ["model.preset=tiny-moe"] + BASE
    cases["moe cp2"] = (2, moe + ["parallel.cp=2"], moe)
    cases["moe dp2 cp2 allgather"] = (4, moe + ["parallel.dp=2", "parallel.cp=2", "parallel.cp_method=allgather",
                                                "train.microbatches=1"], moe)
    cases["moe cp2 tp2"] = (4, moe + ["parallel.cp=2", "parallel.tp=2"], moe)
    # sequence parallelism: each cp rank's zigzag part split again over tp, the statistics summed over both
    cases["moe cp2 tp2 sp"] = (4, moe + ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], moe)
    cases["moe cp2 pp2 1f1b"] = (4, moe + ["parallel.cp=2", "parallel.pp=2", "pipeline.schedule=1f1b",
                                           "train.microbatches=4"], moe + ["train.microbatches=4"])
    # expert parallelism over dp (ep = 2): tokens cross ep by all-to-all within each cp coordinate, the
    # experts (replicated over cp too) sum their gradients over edp and cp in one collective
    ep = ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2", "train.microbatches=1"]
    cases["moe dp2 cp2 ep2 ring"] = (4, moe + ep, moe)
    cases["moe dp2 cp2 ep2 ulysses zero2"] = (4, moe + ep + ["parallel.cp_method=ulysses", "parallel.zero=2"], moe)
    cases["moe dp2 cp2 ep2 allgather zero3"] = (4, moe + ep + ["parallel.cp_method=allgather", "parallel.zero=3"], moe)
    # bf16 against one process in bf16, to BF16_TOL
    for method in ("ring", "allgather", "ulysses"):
        cases[f"llama cp2 {method} bf16"] = (2, LLAMA + BF16 + ["parallel.cp=2", f"parallel.cp_method={method}"],
                                             LLAMA + BF16)
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def runs(worlds, tmp_path_factory):
    root = tmp_path_factory.mktemp("context")
    rng = random.Random(0)
    docs = [[rng.randrange(1, 256) for _ in range(rng.randrange(20, 90))] for _ in range(60)]
    prepared = write_prepared(root / "prepared", docs[:50], docs[50:], vocab=256)

    def concrete(overrides):
        return [o.format(prepared=prepared) if o == DATA else o for o in overrides]

    cases = {name: (n, concrete(ov), ref) for name, (n, ov, ref) in CASES.items()}
    peers = {f"ref {' '.join(ref)}": (n, list(ref), None) for ref, n in PEER_REFS.items()}
    out = run_by_world_size(worlds, train_many, {**cases, **peers}, root)  # the peer refs after the cases
    refs = sorted({tuple(ref) for _, _, ref in CASES.values()} - set(PEER_REFS))
    saved = case_dir(CASES, root, "llama cp2 saved")
    resume = (LLAMA + [f"checkpoint.resume={saved / 'checkpoints' / step_dir_name(SAVED)}"], str(root / "resumed"))
    single = worlds(1).run(train_many, [(concrete(ref), str(root / f"ref{i}")) for i, ref in enumerate(refs)]
                           + [resume])[0]
    out["refs"] = dict(zip(refs, single))
    out["refs"].update({ref: out.pop(name) for ref, (name, _) in zip(PEER_REFS, peers.items())})  # rank lists
    out["resumed"] = single[-1]
    return out


def test_a_cp2_checkpoint_resumes_under_cp1(runs):
    resumed, ref = runs["resumed"], runs["refs"][tuple(LLAMA)]
    assert resumed["resumed_from"] == step_dir_name(SAVED)
    assert len(resumed["losses"]) == STEPS - SAVED
    for step, (a, b) in enumerate(zip(resumed["losses"], ref["losses"][SAVED:]), SAVED + 1):
        assert abs(a - b) <= TOL * abs(b), f"resumed step {step}: loss {a} vs {b}"
    for key, value in ref["params"].items():
        assert rel_err(resumed["params"][key], value) <= TOL, f"resumed: {key} differs"


def _one(ref_ranks: list[dict]) -> dict:
    """A reference of several ranks as one: rank 0's steps (every rank has the step's figures), every
    rank's parameters and placements (keyed by global name, so the pipeline stages' do not collide)."""
    params, placements = {}, {}
    for r in ref_ranks:
        for local, value in r["params"].items():
            place = r["placements"][local]
            assert place.replicated_over or place.name not in params, place.name  # whole, on one stage
            params[place.name], placements[place.name] = value, place
    return {**ref_ranks[0], "params": params, "placements": placements}


@pytest.mark.parametrize("name", list(CASES))
def test_context_parallel_matches_one_process(runs, name):
    results, ref = runs[name], runs["refs"][tuple(CASES[name][2])]
    ref = _one(ref) if isinstance(ref, list) else ref
    tol = BF16_TOL if name.endswith("bf16") else TOL
    assert_steps_match(name, results, ref, tol, steps=STEPS)
    if not name.endswith("bf16"):
        assert_parameters_match(name, results, ref, tol)
    else:  # bf16 updates of near-zero weights differ relatively; the loss trajectory is the check
        assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.parametrize("name", [name for name in CASES if name.endswith("eval")])
def test_validation_loss_under_cp_matches_one_process(runs, name):
    results, ref = runs[name], runs["refs"][tuple(CASES[name][2])]
    assert len(ref["val"]) == STEPS // 2
    for rank_result in results:  # every rank: the last stage's loss is reduced over pp, the shards over dp, cp
        assert len(rank_result["val"]) == STEPS // 2, rank_result["val"]
        for got, want in zip(rank_result["val"], ref["val"]):
            assert abs(got - want) <= TOL * abs(want), (name, rank_result["val"], ref["val"])


def test_the_2bw_reference_is_the_delayed_update(runs):
    """The cp = 1 pipedream-2bw run the cp = 2 one is held to: one process's first step (the same weights
    and batch), then stale by one step - step 1 applies no update (norm 0), step 2 the first batch's
    gradient (the one-process step 1 norm), and every later loss is off the one-process one."""
    plain = runs["refs"][tuple(LLAMA + DEEP)]
    for r in runs["refs"][tuple(TWO_BW)]:
        (first, *later), (norm1, norm2, *_) = r["losses"], r["norms"]
        assert abs(first - plain["losses"][0]) <= TOL * abs(plain["losses"][0])
        assert norm1 == 0.0 and abs(norm2 - plain["norms"][0]) <= TOL * plain["norms"][0], r["norms"]
        assert all(abs(a - b) > 100 * TOL * abs(b) for a, b in zip(later, plain["losses"][1:])), (later, plain)
