"""The planner's cross-entropy time (planner/compute.py `loss_bytes_per_logit`, `loss_seconds`) against
the kernels threefold's loss really issues: every aten operation of one forward and backward of the
loss, recorded with a TorchDispatchMode on the CPU, priced by what its GPU kernel moves over HBM
(tests/unit/test_loss_bytes.py `Traffic`: reads and writes of the logit-sized tensors; views move
nothing; a gather, a scatter or a fill of one number per row is left out, as the planner leaves it
out), must equal the stated bytes per logit: the vocabulary-parallel loss's the planner's, the whole
loss's (tp = 1) models/loss_pieces.py `loss_bytes_per_logit`, in bf16 and fp32."""

import pytest
import torch

from tests.unit.test_loss_bytes import Traffic
from threefold.comm import Comm
from threefold.config import load_config
from threefold.models.cross_entropy import summed_cross_entropy
from threefold.models.loss_pieces import loss_bytes_per_logit as whole_loss_bytes_per_logit
from threefold.parallel.tensor import vocab_parallel_cross_entropy
from threefold.planner.compute import loss_bytes_per_logit, loss_seconds
from threefold.planner.hardware import PRESETS
from threefold.planner.step_time import step_time
from threefold.planner.workload import Strategy, Workload


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
    traffic = Traffic(n * v // 16)  # the eighths of the rows a CPU scales at a time count
    with traffic:
        if vocab_parallel:
            loss = vocab_parallel_cross_entropy(logits, targets, Comm(_Axis()), 0, v).sum()
        else:
            loss = summed_cross_entropy(logits, targets)
        loss.backward()
    assert not traffic.unknown, traffic.unknown
    if vocab_parallel:
        forward, backward = loss_bytes_per_logit("threefold", logits.element_size(), vocab_parallel)
    else:  # the whole loss's figure (models/loss_pieces.py), which the planner is to charge for tp = 1
        forward, backward = whole_loss_bytes_per_logit(logits.element_size())
    assert traffic.bytes == (forward + backward) * n * v, (traffic.bytes / (n * v), forward + backward)


def test_the_loss_is_charged_on_the_last_stage_and_by_the_software():
    h100 = PRESETS["h100-80gb"]
    m = load_config(None, ["model.preset=gpt2-124m"]).model
    f, b = loss_seconds(m, 8, 1024, 1, h100, "bf16")
    assert f > 0 and b > 0
    assert f == pytest.approx(8 * 1024 * m.padded_vocab * 30 / (h100.hbm_bytes_per_s * h100.compute_efficiency))
    mega = loss_seconds(m, 8, 1024, 1, h100, "bf16", "megatron")
    # Megatron keeps the fp32 softmax (more passes forward) and casts its gradient back; threefold's forward
    # writes softmax - one_hot in the logits' dtype and its backward only scales it
    assert mega[0] > f and mega[1] > b
    w = Workload(m, 64, 1024)
    st = Strategy(dp=8, microbatches=1)
    with_loss = step_time(w, st, h100)
    # the planner's step is the GEMM model's plus the loss's seconds on the (only) stage
    assert with_loss.forward_s >= f


def test_gpt2_small_loss_is_a_sizeable_share_of_its_head():
    # GPT-2 124M on an H100: the head GEMM of 50,304 columns and K = 768 (3 x 2 x 768 FLOPs a logit
    # forward and backward) is short next to the loss's passes over the same logits: 66 bytes a logit
    # in bf16 charged 8.7 ms against 2.8 ms for 8 sequences of 1,024; 34 bytes (models/cross_entropy.py
    # since its forward writes the gradient) 4.5 ms, still more than the head's 3 GEMMs
    from threefold.planner.compute import head_forward_seconds
    h100 = PRESETS["h100-80gb"]
    m = load_config(None, ["model.preset=gpt2-124m"]).model
    head = head_forward_seconds(m, 8, 1024, 1, h100, "bf16")
    f, b = loss_seconds(m, 8, 1024, 1, h100, "bf16")
    per_logit = sum(loss_bytes_per_logit("threefold", 2, False))
    assert f + b == pytest.approx(8 * 1024 * m.padded_vocab * per_logit
                                  / (h100.hbm_bytes_per_s * h100.compute_efficiency), rel=1e-9)
    assert f + b > 3 * head * (1.5 if per_logit <= 34 else 3)


@pytest.mark.parametrize("field,value", [("loss", "megatorn"), ("regather", "late"), ("attention", "sparse"),
                                         ("pipeline_p2p", "nccl"), ("implementation", "jax")])
def test_a_workload_names_its_software_from_the_known_choices(field, value):
    m = load_config(None, ["model.preset=tiny"]).model
    with pytest.raises(ValueError, match=f"Workload.{field}: unknown '{value}'"):
        Workload(m, 8, 64, **{field: value})
