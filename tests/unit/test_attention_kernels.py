"""Attention on the fused kernels (models/attention.py, models/hf_attention.py), in one process.

References are plain SDPA under the whole boolean mask, written here: the sliding window's blocks
(query i sees i - w < j <= i) forward and backward within 1e-5 for windows that do and do not divide
the sequence and grouped-query heads; the window through the Hugging Face attention function with
the block's banded mask; the packed documents' FlexAttention path (forward: FlexAttention has no
backward on CPU) against the document mask. Counted at the dispatcher (tests/attention_watch.py):
no host read, no mask handed to a kernel and only fused kernels on every fused path; the path named
for each device and model feature."""

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F

from tests.attention_watch import AttentionWatch
from tests.helpers import rel_err


def _band(s: int, window: int) -> torch.Tensor:
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    return (j <= i) & (j > i - window)


def _inputs(s: int, h: int = 4, hk: int = 2, b: int = 2, d: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, do = torch.randn(b, h, s, d, generator=gen), torch.randn(b, h, s, d, generator=gen)
    k, v = torch.randn(b, hk, s, d, generator=gen), torch.randn(b, hk, s, d, generator=gen)
    return q, k, v, do


def _reference(q, k, v, do, mask):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(g, 1),
                                         leaves[2].repeat_interleave(g, 1), attn_mask=mask)
    out.backward(do)
    return [out.detach()] + [x.grad for x in leaves]


def _ours(fn, q, k, v, do, watch: AttentionWatch | None = None):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with watch if watch is not None else contextlib.nullcontext():
        out = fn(*leaves)
        out.backward(do)
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("s,window", [(16, 4), (17, 4), (18, 5), (12, 2), (16, 16), (7, 3)])
def test_window_blocks_match_the_banded_mask(s, window):
    from threefold.models.attention import window_attention

    q, k, v, do = _inputs(s)
    want = _reference(q, k, v, do, _band(s, window))
    watch = AttentionWatch()
    got = _ours(lambda *x: window_attention(*x, window), q, k, v, do, watch)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(a, b) <= 1e-5, f"s={s} window={window}: {name} differs by {rel_err(a, b):.2e}"
    assert watch.reads == [] and watch.masks == [] and watch.unfused() == []
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in watch.kernels


def test_hf_attention_runs_the_window_without_its_mask():
    """The library's attention call with the block's window (`attention_window`, no mask built): the same
    output as SDPA under the banded mask, no mask reaching a kernel, no host read."""
    from threefold.models.hf_attention import attention

    s, window = 20, 6
    q, k, v, do = _inputs(s, h=4, hk=4)
    band = _band(s, window).view(1, 1, s, s)
    want = _reference(q, k, v, do, band)
    watch = AttentionWatch()
    got = _ours(lambda *x: attention(None, *x, None, scaling=8 ** -0.5, attention_window=window)[0].transpose(1, 2),
                q, k, v, do, watch)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(a, b) <= 1e-5, f"{name} differs by {rel_err(a, b):.2e}"
    assert watch.reads == [] and watch.masks == [] and watch.unfused() == []


def test_the_default_core_is_sdpa_is_causal_on_a_fused_kernel():
    from threefold.models.decoder import CausalCore

    q, k, v, do = _inputs(16)
    want = _reference(q, k, v, do, torch.ones(16, 16, dtype=torch.bool).tril())
    watch = AttentionWatch()
    got = _ours(CausalCore(), q, k, v, do, watch)
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(got, want))
    assert watch.reads == [] and watch.masks == [] and watch.unfused() == [] and watch.kernels


@pytest.mark.filterwarnings("ignore::UserWarning")  # flex uncompiled: the reference implementation, here wanted
def test_documents_through_flex_attention_match_the_document_mask():
    """The CUDA path of packed documents (FlexAttention under a block mask built from the ids), run
    here forward only, uncompiled: FlexAttention has no backward on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    from threefold.data.packing import pack_documents
    from threefold.models.attention import document_attention

    p = pack_documents([[1] * n for n in (5, 2, 7, 9, 3, 4)], 12)
    b, s = p.tokens.shape
    q, k, v, _ = _inputs(s, b=b)
    index = torch.arange(s).expand(b, s)
    mask = torch.ones(s, s, dtype=torch.bool).tril() & (p.documents[:, :, None] == p.documents[:, None, :])
    want = _reference(q, k, v, torch.zeros_like(q), mask[:, None])[0]
    got = document_attention(q, k, v, index, index, p.documents, p.documents, None, flex_attention)
    assert rel_err(got, want) <= 1e-5


def test_the_path_is_chosen_from_the_device_and_named():
    from threefold.models.attention import attention_path, document_kernel

    assert document_kernel("cpu") is None and document_kernel("cuda") is not None  # compiled lazily
    assert attention_path("cpu") == "attention: sdpa is_causal"
    assert attention_path("cuda") == "attention: sdpa is_causal (flash)"
    assert attention_path("cpu", packed=True) == "attention: packed documents, boolean mask (CPU fallback)"
    assert "flex attention" in attention_path("cuda", packed=True, cp_method="allgather")
    assert "fused blocks" in attention_path("cuda", cp_method="ring")
    assert "sliding window, fused" in attention_path("cuda", window=True)


@pytest.mark.parametrize("overrides,line", [
    ([], "attention: sdpa is_causal"),
    (["parallel.cp=2", "parallel.cp_method=ring"], "attention: ring, fused blocks merged by log-sum-exp"),
    (["data.pack=true"], "attention: packed documents, boolean mask (CPU fallback)"),
])
def test_the_summary_names_the_attention_path(tmp_path, overrides, line):
    from threefold.config import load_config
    from threefold.train.summary import attention_line, print_summary

    (tmp_path / "config.toml").write_text(load_config(None, ["run.device=cpu", *overrides]).to_toml())
    assert attention_line(tmp_path) == line
    printed = io.StringIO()
    print_summary(tmp_path, printed)
    assert printed.getvalue().splitlines()[0] == f"threefold: {line}"
    assert attention_line(tmp_path / "elsewhere") is None
