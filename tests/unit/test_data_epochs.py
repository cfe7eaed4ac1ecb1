"""Epochs and mixtures of prepared data: coverage, exact weights, and the same samples at every
step under any layout and after a resume (token ids compared, not losses)."""

import numpy as np
import pytest
import torch

from tests.data_helpers import write_prepared
from threefold.config import DataConfig
from threefold.data.build import build_samplers
from threefold.data.epochs import BLOCK
from threefold.data.loader import Loader
from threefold.errors import UserError

SEQ = 16


def _docs(first: int, count: int, rng) -> list[list[int]]:
    """Documents whose token ids are their global positions: a sample tells which tokens it read."""
    docs, next_id = [], first
    for length in rng.integers(1, 60, size=count):
        docs.append(list(range(next_id, next_id + int(length))))
        next_id += int(length)
    return docs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("epochs")
    code = write_prepared(root / "code", _docs(1, 80, rng), _docs(500_000, 10, rng))
    prose = write_prepared(root / "prose", _docs(1_000_000, 50, rng), _docs(1_500_000, 10, rng))
    return code, prose


def test_every_token_once_per_epoch(dirs):
    sampler, _ = build_samplers(DataConfig(source=str(dirs[0])), SEQ, 8, seed=3, vocab=1 << 20)
    source = sampler.source
    all_ids = set(np.concatenate([np.asarray(d) for d in _docs(1, 80, np.random.default_rng(0))]).tolist())
    per_epoch = source.per_epoch
    assert per_epoch == (len(all_ids) - 1) // SEQ
    orders = []
    for epoch in range(2):
        rows = [source.sample(epoch * per_epoch + p) for p in range(per_epoch)]
        targets = np.concatenate([r[1:] for r in rows])
        assert len(set(targets.tolist())) == targets.size, "a token was a target twice in one epoch"
        left_out = all_ids - set(targets.tolist())
        assert len(left_out) == len(all_ids) - per_epoch * SEQ < SEQ + 1  # the stream's first token + short tail
        assert all(r.size == SEQ + 1 for r in rows)
        orders.append([int(r[0]) for r in rows])
    assert orders[0] != orders[1], "the second epoch must be shuffled differently"
    assert source.state(per_epoch + 5) == {"epoch": 1, "position": 5, "sequences_per_epoch": per_epoch}


def test_mixture_weights_are_exact_and_sources_read_in_order(dirs):
    mix = f"{dirs[0]}:0.7,{dirs[1]}:0.3"
    sampler, _ = build_samplers(DataConfig(sources=mix), SEQ, 10, seed=1, vocab=1 << 20)
    code, _ = build_samplers(DataConfig(source=str(dirs[0])), SEQ, 10, seed=1, vocab=1 << 20)
    prose_only = sampler.source.sources[1]
    rows = [sampler.source.sample(g) for g in range(3 * BLOCK)]
    from_code = [r for r in rows if r[0] < 1_000_000]
    assert len(from_code) == 7 * 3 * BLOCK // 10
    # each source's samples arrive in its own order (its epochs continue across the mixture)
    assert all(np.array_equal(r, code.source.sample(n)) for n, r in enumerate(from_code[:200]))
    from_prose = [r for r in rows if r[0] >= 1_000_000]
    assert all(np.array_equal(r, prose_only.sample(n)) for n, r in enumerate(from_prose[:200]))
    state = sampler.state(150)  # after 1500 samples, mid-block
    code_drawn = sum(int(r[0] < 1_000_000) for r in rows[:1500])
    assert [s["epoch"] * s["sequences_per_epoch"] + s["position"] for s in state["sources"]] == [
        code_drawn, 1500 - code_drawn]


LAYOUTS = [(2, 1, 2), (4, 1, 1), (1, 1, 1)]  # (dp, tp, pp)


def _global_batches(data: DataConfig, layout, steps, microbatches=2, start=0) -> list[torch.Tensor]:
    """The global batch of each step as the ranks of `layout` load it (fresh loaders: a resumed process)."""
    dp, tp, pp = layout
    per_rank = []
    for rank in range(dp * tp * pp):
        dp_rank = rank // (tp * pp)  # tp and pp ranks of one replica read the same rows
        sampler, _ = build_samplers(data, SEQ, 8, seed=7, vocab=1 << 20)
        loader = Loader(sampler, microbatches, dp_rank, dp, torch.device("cpu"), depth=2)
        per_rank.append([torch.cat([b.inputs for b in loader.get(s)[0]]) for s in range(start, start + steps)])
        loader.close()
    replicas = [per_rank[r * tp * pp] for r in range(dp)]
    for r in range(dp * tp * pp):
        assert all(torch.equal(a, b) for a, b in zip(per_rank[r], replicas[r // (tp * pp)]))
    return [torch.cat([rep[s] for rep in replicas]) for s in range(steps)]


@pytest.mark.parametrize("mixture", [False, True])
def test_resume_mid_epoch_under_other_layouts_gives_the_same_tokens(dirs, mixture):
    data = DataConfig(sources=f"{dirs[0]}:0.7,{dirs[1]}:0.3") if mixture else DataConfig(source=str(dirs[0]))
    sampler, _ = build_samplers(data, SEQ, 8, seed=7, vocab=1 << 20)
    steps = 2 * (sampler.source.per_epoch if not mixture else sampler.source.sources[1].per_epoch) // 8 + 3
    # uninterrupted on one process, reference built without the loader: the sampler's rows directly
    whole = [sampler.step_batch(s).inputs for s in range(steps)]
    saved_at = steps // 2 + 1  # mid-epoch
    before = _global_batches(data, LAYOUTS[0], saved_at)
    assert all(torch.equal(a, b) for a, b in zip(before, whole[:saved_at]))
    for layout in LAYOUTS[1:]:
        after = _global_batches(data, layout, steps - saved_at, start=saved_at)
        for step, (a, b) in enumerate(zip(after, whole[saved_at:]), saved_at):
            assert torch.equal(a, b), f"layout {layout}: step {step} read other tokens"


def test_bad_mixtures(dirs, tmp_path):
    other = write_prepared(tmp_path / "other", [[1, 2, 3] * 20], sha="1" * 64)
    from threefold.config import load_config

    with pytest.raises(UserError, match=r"'.*other' was tokenized by the hf tokenizer 'hand'.*sha256 111111"):
        load_config(overrides=[f"data.sources={dirs[0]}:1,{other}:1"]).validate(1)
    with pytest.raises(UserError, match="is not a prepared data directory"):
        load_config(overrides=[f"data.sources={tmp_path}:1"]).validate(1)
    with pytest.raises(UserError, match="weight 'x' of"):
        load_config(overrides=[f"data.sources={dirs[0]}:x"]).validate(1)
    with pytest.raises(UserError, match="train.eval_every: validation needs a held-out split"):
        load_config(overrides=["train.eval_every=2"]).validate(1)
    cfg = load_config(overrides=[f"data.source={dirs[0]}"]).validate(1)
    assert cfg.model.vocab == 1 << 20  # the model's vocabulary is the data's tokenizer's
