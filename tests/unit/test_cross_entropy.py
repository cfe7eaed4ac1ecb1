"""models/cross_entropy.py and the vocabulary-parallel loss (parallel/tensor.py) against
F.cross_entropy on fp32 logits: loss and gradient, in fp32 (1e-6) and bf16 (bf16 rounding), with
the fp32 work cut into several chunks of rows, padded columns excluded; and what autograd keeps:
the logits in their own dtype and 4 bytes per token, never an fp32 copy."""

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
    monkeypatch.setattr(cross_entropy, "chunk_rows", lambda vocab: 5)
    monkeypatch.setattr(tensor, "chunk_rows", lambda vocab: 5)
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(N, V, generator=gen)).to(dtype)
    logits[:, valid:] = 50.0  # padding columns: large logits that must not count
    targets = torch.randint(0, valid, (N,), generator=gen)
    ref_loss, ref_grad = reference(logits, targets, valid)
    loss, grad, saved = ours(logits, targets, valid, parallel)
    assert grad.dtype == dtype
    assert rel_err(loss, ref_loss) < 1e-6
    # fp32: the same sums; bf16: the fp32 gradient rounded once to bf16, as autograd rounds F.cross_entropy's
    assert rel_err(grad[:, :valid], ref_grad) < (1e-6 if dtype == torch.float32 else 2**-8), (dtype, valid)
    assert torch.equal(grad[:, valid:], torch.zeros(N, V - valid, dtype=dtype))
    # kept for backward: the logits themselves, the fp32 log-sum-exp, the targets (whole: the caller's;
    # vocabulary-parallel: the local ids and their in-slice mask)
    ids = 8 * N + (N if parallel else 0)
    assert saved == logits.element_size() * N * V + 4 * N + ids, (saved, dtype)
