"""Packing whole documents into rows (data/packing.py) and training on them (data.pack): exact rows, ids,
positions, padding; the ignore index; a packed batch against each document alone; the packed sampler
and loader; the refusals."""

import random

import pytest
import torch

from threefold.data.packing import pack_documents


def test_rows_written_out():
    docs = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15], [], [16]]
    p = pack_documents(docs, 8, pad_id=0)
    assert p.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0], [8, 9, 10, 11, 12, 13, 14, 15], [16, 0, 0, 0, 0, 0, 0, 0]]
    assert p.documents.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert p.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert p.real.tolist() == [[True] * 7 + [False], [True] * 8, [True] + [False] * 7]


def test_a_document_longer_than_a_row_is_cut_into_rows():
    p = pack_documents([[7, 7], list(range(20, 31)), [5]], 4, pad_id=-1)
    assert p.tokens.tolist() == [[7, 7, -1, -1], [20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 5]]
    assert p.documents.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]
    assert p.positions.tolist() == [[0, 1, 0, 1], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 0]]


@pytest.mark.parametrize("seed", range(5))
def test_whole_documents_in_order_with_restarting_positions(seed):
    rng = random.Random(seed)
    length = 16
    docs = [[rng.randrange(1, 100) for _ in range(rng.randrange(1, length + 1))] for _ in range(40)]
    p = pack_documents(docs, length)
    assert p.tokens.dtype == p.documents.dtype == p.positions.dtype == torch.int64
    assert p.tokens[p.real].tolist() == [t for d in docs for t in d]  # nothing lost, reordered or duplicated
    seen = []
    for r in range(p.tokens.shape[0]):
        ids = p.documents[r]
        assert ids[0] == 0 and bool(((ids[1:] - ids[:-1]) >= 0).all()) and bool(((ids[1:] - ids[:-1]) <= 1).all())
        for d in ids.unique().tolist():
            where = ids == d
            assert p.positions[r][where].tolist() == list(range(int(where.sum())))  # restart per document
            if bool(p.real[r][where].all()):
                seen.append(p.tokens[r][where].tolist())
            else:
                assert not bool(p.real[r][where].any()) and d == int(ids.max())  # padding: the last id of its row
    assert seen == docs  # every document whole, in one row


def test_bad_length():
    with pytest.raises(ValueError):
        pack_documents([[1]], 0)


def test_packed_rows_attend_by_document_in_one_process(alone):
    """Without cp (an axis of one rank) every method's document mask is the whole-row reference's:
    SDPA under causal & same-document, padding a document of its own."""
    import torch.nn.functional as F

    from threefold.comm.collectives import Comm
    from threefold.mesh import Layout, Mesh, init_distributed
    from threefold.parallel.context import METHODS, context_attention

    init_distributed(torch.device("cpu"))
    comm = Comm(Mesh(Layout(), torch.device("cpu")))
    p = pack_documents([[1] * n for n in (5, 2, 7, 9, 3, 4)], 12)
    b, s = p.tokens.shape
    gen = torch.Generator().manual_seed(0)
    q, do = torch.randn(b, 4, s, 8, generator=gen), torch.randn(b, 4, s, 8, generator=gen)
    k, v = torch.randn(b, 2, s, 8, generator=gen), torch.randn(b, 2, s, 8, generator=gen)
    mask = torch.ones(s, s, dtype=torch.bool).tril() & (p.documents[:, :, None] == p.documents[:, None, :])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(leaves[0], *(x.repeat_interleave(2, 1) for x in leaves[1:]),
                                          attn_mask=mask[:, None])
    want.backward(do)
    for method in METHODS:
        got_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        got = context_attention(method, *got_leaves, comm, "dp", torch.arange(s), p.documents)
        got.backward(do)
        assert (got - want).norm() <= 1e-5 * want.norm(), method
        for a, e in zip(got_leaves, leaves):
            assert (a.grad - e.grad).norm() <= 1e-5 * e.grad.norm(), method
    assert comm.traffic.total_bytes() == 0


# ------------------------------------------------------------------ the loss's ignore index


def test_ignored_targets_add_nothing_and_get_no_gradient():
    from threefold.models.cross_entropy import IGNORE_INDEX, summed_cross_entropy

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 30, generator=gen)
    targets = torch.randint(0, 30, (40,), generator=gen)
    targets[::3] = IGNORE_INDEX
    leaf = logits.clone().requires_grad_()
    got = summed_cross_entropy(leaf, targets)
    got.backward()
    got = got.detach()
    want = torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    assert not leaf.grad[targets == IGNORE_INDEX].any() and leaf.grad[targets != IGNORE_INDEX].abs().sum() > 0


# ------------------------------------------------------------------ a packed batch = each document alone


class _Rows:
    """A PackedSource over the rows of one `Packed` (sample g = row g)."""

    def __init__(self, packed):
        self.packed = packed

    def row(self, g):
        from threefold.data.packing import Packed

        p = self.packed
        return Packed(p.tokens[g:g + 1], p.documents[g:g + 1], p.positions[g:g + 1], p.real[g:g + 1])

    def state(self, samples):
        return {}


@pytest.mark.parametrize("preset, method, extra", [
    ("tiny-llama", "allgather", []), ("tiny-llama", "ring", []), ("tiny-llama", "allgather", ["model.loss_chunk=8"]),
    ("tiny", "allgather", []),
])
def test_packed_batch_equals_each_document_alone(alone, preset, method, extra):
    """Per-token losses and parameter gradients of a packed batch (the document mask and restarting
    positions of a ContextCore over the cp axis of one rank, the targets that do not count ignored)
    against a plain model run on each document separately, positions from 0, relative 1e-5 in fp32."""
    import copy

    from threefold.comm.collectives import Comm
    from threefold.config import load_config
    from threefold.data.sampler import PackedSampler
    from threefold.mesh import Layout, Mesh, init_distributed
    from threefold.models.cross_entropy import IGNORE_INDEX
    from threefold.models.decoder import build_model
    from threefold.models.reference import decoder_spec
    from threefold.parallel.context import install_documents
    from threefold.train.step import hand_documents, split_sequences

    init_distributed(torch.device("cpu"))
    comm = Comm(Mesh(Layout(), torch.device("cpu")))
    seq = 24
    cfg = load_config(None, [f"model.preset={preset}", *extra]).model
    model = build_model(cfg, 0)
    reference = copy.deepcopy(model)  # the plain decoder: causal SDPA, positions 0 .. s-1
    rng = random.Random(1)
    docs = [[rng.randrange(1, cfg.vocab) for _ in range(n)] for n in (7, 1, 12, 25, 3, 9, 2, 30, 5, 16)]
    packed = pack_documents(docs, seq + 1, pad_id=0)
    rows = packed.tokens.shape[0]
    batch = PackedSampler(_Rows(packed), seq, rows).samples(0, rows)
    (mb,) = split_sequences([batch], comm, packed=True)
    documents = install_documents(model, decoder_spec(cfg, 0).context, comm, "cp", method, seq)
    hand_documents(documents, mb)
    model(mb.inputs, mb.targets).backward()
    with torch.no_grad():
        logits = model(mb.inputs)
    token_losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="none",
                                                     ignore_index=IGNORE_INDEX)
    got = token_losses[mb.targets.flatten() != IGNORE_INDEX]

    want = []  # each piece (a document, or a row-sized part of a longer one) alone, in packing order
    for r in range(rows):
        for d in packed.documents[r][packed.real[r]].unique().tolist():
            piece = packed.tokens[r][(packed.documents[r] == d) & packed.real[r]][None]
            if piece.shape[1] < 2:
                continue  # one token: no target
            reference(piece[:, :-1], piece[:, 1:]).backward()
            with torch.no_grad():
                want.append(torch.nn.functional.cross_entropy(reference(piece[:, :-1])[0], piece[0, 1:],
                                                              reduction="none"))
    want = torch.cat(want)
    assert got.shape == want.shape == (sum(len(d) - 1 for d in docs) - 1,)  # 30 tokens: cut into two rows
    assert (got - want).norm() <= 1e-5 * want.norm()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        assert (p.grad - q.grad).norm() <= 1e-5 * q.grad.norm(), name


# ------------------------------------------------------------------ the sampler and the loader (data.pack)


def _packed_sampler(directory, seq=16, batch=4, seed=3):
    from threefold.config import DataConfig
    from threefold.data.build import build_samplers

    sampler, val = build_samplers(DataConfig(source=str(directory), pack=True), seq, batch, seed, 1 << 20,
                                  validation=True)
    return sampler, val


@pytest.fixture
def prepared(tmp_path):
    from tests.data_helpers import write_prepared

    rng = random.Random(2)
    # distinct first tokens name the documents; lengths from 1 to beyond a row (17 tokens)
    docs = [[1000 + i] + [rng.randrange(1, 999) for _ in range(rng.choice([0, 1, 4, 9, 15, 16, 20, 40]))]
            for i in range(30)]
    return write_prepared(tmp_path / "prepared", docs, docs[:6], vocab=2000), docs


def test_packed_rows_hold_whole_documents_in_epoch_order(prepared):
    """One epoch's rows, put back in packing order: the documents in the epoch's shuffled order, each
    whole in one row unless longer than a row (then cut into row-sized pieces, each starting a row),
    positions restarting per piece; the batch counts exactly the targets inside a piece."""
    from threefold.data.epochs import shuffled

    directory, docs = prepared
    sampler, _ = _packed_sampler(directory)  # rows of 17 tokens
    source = sampler.rows
    *_, starts, reading = source._epoch(0)
    rows = starts.size - 1
    assert source.state(rows) == {"epoch": 1, "position": 0, "rows_in_epoch": source._epoch(1)[3].size - 1}
    sample_of = {int(r): p for p, r in enumerate(reading.tolist())}  # plan row -> the sample reading it
    order = shuffled(len(docs), 3, 0, 0, 0).tolist()  # the epoch's document order (seed 3, salt 0)
    pieces = []
    for r in range(rows):
        packed = source.row(sample_of[r])
        ids, real = packed.documents[0], packed.real[0]
        for d in ids[real].unique().tolist():
            where = ids == d
            assert packed.positions[0][where].tolist() == list(range(int(where.sum())))
            pieces.append((r, packed.tokens[0][where].tolist()))
        assert torch.equal(real, torch.arange(17) < int(real.sum()))  # padding only after the row's documents
    expected = []
    for i in order:
        doc = docs[i]
        expected += [doc[k:k + 17] for k in range(0, len(doc), 17)]
    assert [piece for _, piece in pieces] == expected  # whole, in order, nothing lost or repeated
    for (r, piece), (r_next, _) in zip(pieces, pieces[1:]):
        if len(piece) == 17:
            assert r_next == r + 1  # a full row: the next piece starts the next row
    batch = sampler.samples(0, rows)
    assert int(batch.packing.counted.sum()) == sum(len(p) - 1 for p in expected)


def test_counted_targets_are_the_next_token_of_the_same_document(prepared):
    from threefold.models.cross_entropy import IGNORE_INDEX
    from threefold.train.step import split_sequences

    directory, docs = prepared
    sampler, _ = _packed_sampler(directory)
    batch = sampler.step_batch(1)
    by_first = {d[0]: d for d in docs}
    for r in range(batch.inputs.shape[0]):
        ids = batch.packing.documents[r]
        for d in ids.unique().tolist():
            where = ids == d
            inputs, targets = batch.inputs[r][where], batch.targets[r][where]
            if int(inputs[0]) in by_first and bool(batch.packing.counted[r][where].any()):
                doc = by_first[int(inputs[0])]
                n = int(batch.packing.counted[r][where].sum())
                assert targets[:n].tolist() == doc[1:n + 1]
    class _Comm:  # split_sequences reads only the cp axis's size
        class mesh:
            @staticmethod
            def size(axis):
                return 1
    (mb,) = split_sequences([batch], _Comm(), packed=True)
    assert torch.equal(mb.targets == IGNORE_INDEX, ~batch.packing.counted)
    assert torch.equal(mb.targets[batch.packing.counted], batch.targets[batch.packing.counted])


def test_packed_sampling_is_a_pure_function_of_the_step(prepared):
    """Resume: a fresh sampler at step k (with no earlier epoch packed yet) gives bitwise the batch the
    running one gave, across epochs; the loader's background thread gives the same micro-batches."""
    from threefold.data.loader import Loader

    directory, _ = prepared
    running, val = _packed_sampler(directory)
    batches = [running.step_batch(k) for k in range(12)]  # several epochs of rows
    assert running.state(12)["epoch"] >= 2
    for k in (11, 5, 0, 7):
        fresh, _ = _packed_sampler(directory)
        again = fresh.step_batch(k)
        for a, b in ((again.inputs, batches[k].inputs), (again.targets, batches[k].targets),
                     (again.packing.documents, batches[k].packing.documents),
                     (again.packing.positions, batches[k].packing.positions),
                     (again.packing.counted, batches[k].packing.counted)):
            assert torch.equal(a, b), k
        assert fresh.state(k * 4) == running.state(k * 4)
    loader = Loader(_packed_sampler(directory)[0], 2, 1, 2, torch.device("cpu"), depth=2)
    try:
        for k in (0, 1, 2):
            got, _ = loader.get(k)
            want = running.step_batch(k, 1, 2).chunk(2)
            for g, w in zip(got, want):
                assert torch.equal(g.inputs, w.inputs) and torch.equal(g.packing.documents, w.packing.documents)
                assert torch.equal(g.packing.counted, w.packing.counted)
    finally:
        loader.close()
    assert val.step_batch(0).packing is not None  # the validation split is packed too
    other, _ = _packed_sampler(directory, seed=4)
    assert not torch.equal(other.step_batch(0).inputs, batches[0].inputs)  # the seed shuffles


def test_a_mixture_of_packed_sources(prepared, tmp_path):
    from threefold.config import DataConfig
    from threefold.data.build import build_samplers
    from tests.data_helpers import write_prepared

    directory, docs = prepared
    second = write_prepared(tmp_path / "second", [[1999, 5, 6, 7]] * 8, vocab=2000)
    sampler, _ = build_samplers(DataConfig(sources=f"{directory}:0.5,{second}:0.5", pack=True), 16, 4, 0, 2000)
    batch = sampler.step_batch(0)
    assert batch.packing is not None and batch.inputs.shape == (4, 16)
    assert set(sampler.state(1)["sources"][1]) == {"epoch", "position", "rows_in_epoch"}


# ------------------------------------------------------------------ refusals (one line, exit 2)


def _config(*overrides: str, data: str = "", world: int = 1):
    from threefold.config import load_config

    return load_config(None, ["model.preset=tiny-llama", "train.seq_len=16", "data.pack=true",
                              *([f"data.source={data}"] if data else []), *overrides]).validate(world)


@pytest.mark.parametrize("overrides, world, message", [
    (["parallel.pp=2"], 2, "data.pack: packed rows with parallel.pp=2 are not wired yet; use parallel.pp=1 or "
     "data.pack=false"),
    (["parallel.tp=2"], 2, "data.pack: packed rows with parallel.tp=2 are not wired yet; use parallel.tp=1 or "
     "data.pack=false"),
    (["model.preset=tiny-moe"], 1, "data.pack: packed rows with mixture-of-experts routing (model.experts=4) are "
     "not wired yet; use a dense model or data.pack=false"),
    (["train.compile=true"], 1, "data.pack: packed rows with train.compile=true are not wired yet; use "
     "train.compile=false or data.pack=false"),
    (["fault.rank=0", "fault.kind=perturb"], 1, "data.pack: packed rows with fault.kind=perturb are not wired yet; "
     "use another fault.kind or data.pack=false"),
    (["model.preset=py:mymodel:build"], 1, "data.pack: model.preset=py:mymodel:build: a module of your own has no "
     "attention to mask by document; use threefold's own decoder or data.pack=false"),
])
def test_pack_refusals_are_one_line(prepared, overrides, world, message):
    from threefold.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _config(*overrides, data=str(prepared[0]), world=world)
    assert str(e.value) == message and "\n" not in e.value.line()


def test_pack_needs_prepared_data_and_threefolds_decoder(tmp_path):
    import dataclasses
    import json

    from threefold.config.checks import _validate_packing
    from threefold.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _config()
    assert str(e.value) == ("data.pack: packs whole documents, whose boundaries only a directory made by `threefold "
                            "data prepare` records, not 'synthetic'; train from one (--data DIR) or set "
                            "data.pack=false")
    # an architecture threefold does not build has no attention seam (every family it builds has one,
    # GPT-2 and the mixtures of experts included: tests/unit/test_context_config.py)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gptj", "architectures": ["GPTJForCausalLM"]}))
    from threefold.config import load_config

    cfg = load_config(None, ["data.pack=true", "data.sources=x:1"])
    hf = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset=f"hf:{tmp_path}"))
    with pytest.raises(ConfigError) as e:
        _validate_packing(hf)
    assert str(e.value).startswith(f"data.pack: the Hugging Face model hf:{tmp_path} has no "
                                   "attention seam to mask by document")


def test_pack_is_refused_for_a_plain_module():
    from threefold.config import load_config
    from threefold.errors import ConfigError
    from threefold.parallel.module import refuse_unplanned

    with pytest.raises(ConfigError, match=r"^data.pack: packed rows need the document mask of threefold's own "
                                          r"decoder, which a plain nn.Module does not have; set data.pack=false$"):
        refuse_unplanned(load_config(None, ["data.pack=true"]))


def test_the_command_line_refuses_in_one_line(tmp_path, capsys):
    from threefold.cli import main

    assert main(["train", "--steps", "1", "--no-progress", "--out", str(tmp_path / "run"), "--set",
                 "data.pack=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("threefold: error: data.pack: packs whole documents"), err
