"""models/cross_entropy.py and the vocabulary-parallel loss (parallel/tensor.py) against
F.cross_entropy on fp32 logits: loss and gradient, in fp32 (1e-6) and bf16 (bf16 rounding), with
the fp32 work cut into several chunks of rows, padded columns excluded, ignored targets (-100) in
the whole loss; and what autograd keeps: logits-sized tensors in the logits' own dtype (the whole
loss: its gradient, in place of the logits), never an fp32 copy. The loss without a gradient
(evaluation) against the same reference; under torch.compile: tests/unit/test_loss_bytes.py."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from tests.unit.test_tensor import StubMesh
from threefold.comm import Comm
from threefold.models import cross_entropy
from threefold.observe.memory import SavedTensorMeter
from threefold.parallel import tensor
from threefold.parallel.tensor import vocab_parallel_cross_entropy

N, V, VALID = 37, 100, 90  # 37 tokens in chunks of 5 rows; columns 90..99 are vocabulary padding


def reference(logits: torch.Tensor, targets: torch.Tensor, valid: int):
    y = logits[:, :valid].detach().float().requires_grad_()
    loss = F.cross_entropy(y, targets, reduction="sum")
    loss.backward()
    return loss.detach(), y.grad.to(logits.dtype)


def ours(logits: torch.Tensor, targets: torch.Tensor, valid: int, parallel: bool):
    x = logits.clone().requires_grad_()
    meter = SavedTensorMeter()
    with meter.measure():
        loss = (vocab_parallel_cross_entropy(x, targets, Comm(StubMesh(1, 0)), start=0, vocab=valid).sum()
                if parallel else cross_entropy.summed_cross_entropy(x, targets, valid))
    loss.backward()
    return loss.detach(), x.grad, meter.peak


@pytest.mark.parametrize("parallel", [False, True], ids=["whole", "vocab-parallel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("valid", [V, VALID])
def test_cross_entropy_in_the_logits_dtype_equals_fp32_cross_entropy(monkeypatch, parallel, dtype, valid):
    monkeypatch.setattr(cross_entropy, "chunk_rows", lambda rows, vocab, logit_bytes: 5)
    monkeypatch.setattr(tensor, "chunk_rows", lambda rows, vocab, logit_bytes: 5)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(N, V, generator=gen)).to(dtype)
    logits[:, valid:] = 50.0  # padding columns: large logits that must not count
    targets = torch.randint(0, valid, (N,), generator=gen)
    if not parallel:  # the vocabulary-parallel loss has no ignored targets (config/checks.py: packing needs tp = 1)
        targets[::6] = cross_entropy.IGNORE_INDEX
    ref_loss, ref_grad = reference(logits, targets, valid)
    loss, grad, saved = ours(logits, targets, valid, parallel)
    assert grad.dtype == dtype
    assert rel_err(loss, ref_loss) < 1e-6
    # fp32: the same sums; bf16: the fp32 gradient rounded once to bf16, as autograd rounds F.cross_entropy's
    assert rel_err(grad[:, :valid], ref_grad) < (1e-6 if dtype == torch.float32 else 2**-8), (dtype, valid)
    assert torch.equal(grad[:, valid:], torch.zeros(N, V - valid, dtype=dtype))
    # kept for backward: logits-sized in their dtype (whole: the gradient written in the forward, in place of
    # the logits; vocabulary-parallel: the logits and the fp32 log-sum-exp), the targets (whole: the
    # caller's; vocabulary-parallel: the local ids and their in-slice mask)
    ids = 8 * N + (N + 4 * N if parallel else 0)
    assert saved == logits.element_size() * N * V + ids, (saved, dtype)


def _chunks(rows: int, vocab: int, logit_bytes: int) -> int:
    from threefold.models.loss_pieces import chunk_rows

    return -(-rows // chunk_rows(rows, vocab, logit_bytes))


def test_the_chunk_count_comes_from_the_memory_it_saves():
    """One chunk when the fp32 working memory of all rows fits max(128 MiB, the logits' bytes); else
    a handful (it was 50 chunks of 2^24 logits for GPT-2, 64 for a 1B Llama: a Python loop of kernels)."""
    from threefold.models.loss_pieces import chunk_rows
    from threefold.planner import memory

    assert _chunks(16 * 1024, 50304, 2) == 4  # GPT-2 124M in bf16: 8 bytes a logit within the logits' 2
    assert _chunks(4 * 2048, 128256, 2) == 4  # a 1B Llama
    assert _chunks(16 * 1024, 50304, 4) == 2  # fp32 logits
    assert _chunks(4 * 256, 8192, 2) == 1  # fits the floor: one chunk
    assert _chunks(8 * 32, 256, 4) == 1
    for rows, vocab, size in ((16 * 1024, 50304, 2), (4 * 2048, 128256, 2), (1000, 50304, 4), (7, 3, 2)):
        step = chunk_rows(rows, vocab, size)
        assert 8 * step * vocab <= max(1 << 27, rows * vocab * size) or step == 1  # within the budget
        assert step * (-(-rows // step)) - rows < -(-rows // step)  # equal chunks, the last one short by < count
    assert memory.chunk_rows is chunk_rows  # the planner counts the same chunk


def test_the_loss_of_logits_that_fit_runs_one_chunk():
    """The kernels of the loss do not grow with the rows while they fit: one chunk's worth."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for rows in (64, 4096):
        logits = torch.randn(rows, 256, requires_grad=True)
        targets = torch.randint(0, 256, (rows,))
        with Ops() as ops:
            cross_entropy.summed_cross_entropy(logits, targets).backward()
        counts.append(ops.n)
    assert counts[0] == counts[1], counts


def _case(dtype=torch.float32, valid=VALID):
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(N, V, generator=gen)).to(dtype)
    logits[:, valid:] = 50.0
    targets = torch.randint(0, valid, (N,), generator=gen)
    targets[::5] = cross_entropy.IGNORE_INDEX
    return logits, targets


def test_the_loss_without_a_gradient_is_the_same_loss():
    """Evaluation (no_grad, or logits that need no gradient) writes no gradient buffer; same loss."""
    logits, targets = _case()
    ref_loss, _ = reference(logits, targets, VALID)
    with torch.no_grad():
        assert rel_err(cross_entropy.summed_cross_entropy(logits.requires_grad_(), targets, VALID), ref_loss) < 1e-6
    assert rel_err(cross_entropy.summed_cross_entropy(logits.detach(), targets, VALID), ref_loss) < 1e-6


def test_a_retained_graph_gives_the_same_gradient_twice():
    logits, targets = _case()
    x = logits.requires_grad_()
    loss = 2 * cross_entropy.summed_cross_entropy(x, targets, VALID)
    first = torch.autograd.grad(loss, x, retain_graph=True)[0]
    assert torch.equal(torch.autograd.grad(loss, x)[0], first)
    assert rel_err(first[:, :VALID], 2 * reference(logits.detach(), targets, VALID)[1]) < 1e-6



def test_the_loss_holds_one_fp32_copy_of_a_chunk():
    """Forward and backward of bf16 logits in one chunk allocate the gradient buffer (2 bytes a logit)
    and one fp32 copy of the rows that the softmax overwrites (4); backward the scaled gradient (2) while
    the buffer lives, and on a CPU an eighth of the rows' fp32 temporaries of the cast (1): at most 6
    bytes a logit at once (a separate softmax output would be 10, a whole cast's temporaries 12)."""
    from threefold.observe.memory import allocation_peak

    n, v = 64, 4096
    logits = torch.randn(n, v).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,))
    peak = allocation_peak(lambda: cross_entropy.summed_cross_entropy(logits, targets, v - 96).backward())
    assert 6 * n * v <= peak < 6.5 * n * v, peak / (n * v)
