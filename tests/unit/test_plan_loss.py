"""The planner's cross-entropy time (planner/compute.py `loss_bytes_per_logit`, `loss_seconds`) against
the kernels threefold's loss really issues: every aten operation of one forward and backward of the
loss, recorded with a TorchDispatchMode on the CPU, priced by what its GPU kernel moves over HBM
(reads and writes of the logit-sized tensors; views move nothing; a gather, a scatter or a fill of one
number per row is left out, as the planner leaves it out; torch.logsumexp is its CUDA kernels' amax,
subtract, exp and sum), must equal the planner's bytes per logit, for the whole-vocabulary loss
(tp = 1) and the vocabulary-parallel one, in bf16 and fp32."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from threefold.comm import Comm
from threefold.config import load_config
from threefold.models.cross_entropy import summed_cross_entropy
from threefold.parallel.tensor import vocab_parallel_cross_entropy
from threefold.planner.compute import loss_bytes_per_logit, loss_seconds
from threefold.planner.hardware import PRESETS
from threefold.planner.step_time import step_time
from threefold.planner.workload import Strategy, Workload

VIEWS = {"alias", "detach", "slice", "view", "unsqueeze", "squeeze", "expand", "t", "transpose", "select",
         "_unsafe_view", "as_strided", "reshape"}
SMALL = {"gather", "scatter_add_", "scatter_add", "full", "empty", "zeros", "fill_", "masked_fill",
         "masked_fill_", "eq", "ones_like", "sum", "log_", "add_", "sub"}  # one number per row at most


class Traffic(TorchDispatchMode):
    """HBM bytes the operations on (rows x vocab)-sized tensors would move on a GPU."""

    def __init__(self, big: int):
        super().__init__()
        self.big, self.bytes, self.unknown = big, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.numel() >= self.big]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.numel() >= self.big]
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        if not tensors and not outs or name in VIEWS:
            return out
        if name == "logsumexp":  # CUDA: amax, (x - max), exp_, sum over an fp32 input
            self.bytes += 6 * size(tensors)
        elif name in ("_to_copy", "copy_", "sub_", "exp_", "mul_", "div_"):
            self.bytes += size(tensors) + (size(outs) if name == "_to_copy" else 0)
            if name in ("sub_", "exp_", "mul_", "div_"):  # in place: the operand read and written back
                self.bytes += size(outs)
            if name == "copy_":
                self.bytes += 0  # the source read (in `tensors`) and the destination written (`tensors` too)
        elif name in ("amax",):
            self.bytes += size(tensors)
        elif name in ("sum",) and tensors:  # a reduction over the logits: read once
            self.bytes += size(tensors)
        elif name not in SMALL:
            self.unknown.append(name)
        return out


class _Axis:
    device = torch.device("cpu")

    def size(self, axis):
        return 1

    def rank(self, axis):
        return 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab_parallel", [False, True])
def test_loss_bytes_per_logit_are_the_kernels_of_threefolds_loss(dtype, vocab_parallel):
    n, v = 48, 1000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(n, v, generator=gen).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    traffic = Traffic(n * v)
    with traffic:
        if vocab_parallel:
            loss = vocab_parallel_cross_entropy(logits, targets, Comm(_Axis()), 0, v).sum()
        else:
            loss = summed_cross_entropy(logits, targets)
        loss.backward()
    assert not traffic.unknown, traffic.unknown
    forward, backward = loss_bytes_per_logit("threefold", logits.element_size(), vocab_parallel)
    assert traffic.bytes == (forward + backward) * n * v, (traffic.bytes / (n * v), forward + backward)


def test_the_loss_is_charged_on_the_last_stage_and_by_the_software():
    h100 = PRESETS["h100-80gb"]
    m = load_config(None, ["model.preset=gpt2-124m"]).model
    f, b = loss_seconds(m, 8, 1024, 1, h100, "bf16")
    assert f > 0 and b > 0
    assert f == pytest.approx(8 * 1024 * m.padded_vocab * 30 / (h100.hbm_bytes_per_s * h100.compute_efficiency))
    mega = loss_seconds(m, 8, 1024, 1, h100, "bf16", "megatron")
    assert mega[0] > f and mega[1] < b  # Megatron keeps the fp32 softmax: more passes forward, one backward
    w = Workload(m, 64, 1024)
    st = Strategy(dp=8, microbatches=1)
    with_loss = step_time(w, st, h100)
    # the planner's step is the GEMM model's plus the loss's seconds on the (only) stage
    assert with_loss.forward_s >= f


def test_gpt2_small_loss_is_a_sizeable_share_of_its_head():
    # GPT-2 124M on an H100: the head GEMM of 50,304 columns and K = 768 is short next to the
    # loss's passes over the same logits (30 + 36 bytes a logit in bf16 against 3 x 2 x 768 FLOPs):
    # 8.7 ms against 2.8 ms for 8 sequences of 1,024
    from threefold.planner.compute import head_forward_seconds
    h100 = PRESETS["h100-80gb"]
    m = load_config(None, ["model.preset=gpt2-124m"]).model
    head = head_forward_seconds(m, 8, 1024, 1, h100, "bf16")
    f, b = loss_seconds(m, 8, 1024, 1, h100, "bf16")
    assert f + b == pytest.approx(3.1 * 3 * head, rel=0.01)


@pytest.mark.parametrize("field,value", [("loss", "megatorn"), ("regather", "late"), ("attention", "sparse"),
                                         ("pipeline_p2p", "nccl"), ("implementation", "jax")])
def test_a_workload_names_its_software_from_the_known_choices(field, value):
    m = load_config(None, ["model.preset=tiny"]).model
    with pytest.raises(ValueError, match=f"Workload.{field}: unknown '{value}'"):
        Workload(m, 8, 64, **{field: value})
