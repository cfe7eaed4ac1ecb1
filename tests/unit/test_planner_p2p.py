"""Pipeline point-to-point as each software stack runs it (planner/pipeline_p2p.py), against the
arithmetic written out from the A100 preset's links: HDR InfiniBand 25 GB/s and NVLink 3 300 GB/s per
direction, both at 80%, latencies 12 and 5 microseconds."""

from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.planner.hardware import PRESETS
from threefold.planner.pipeline_p2p import p2p_seconds
from threefold.planner.step_time import step_time
from threefold.planner.workload import Strategy, Workload

A100 = PRESETS["a100-80gb"]
MODEL = replace(load_config(None, ["model.preset=gpt3-175b"]).model, hidden=20480, heads=128, kv_heads=128,
                layers=105, ffn_hidden=4 * 20480, vocab=51200, max_seq=2048)  # MT-NLG 530B
WHOLE = 2 * 1 * 2048 * 20480  # bf16 (b=1, s=2048, h=20480) between two stages
TRANSFER = 12e-6 + WHOLE / 8 / (25e9 * 0.8)  # 1/tp of it, one rank's InfiniBand port
GATHER = 7 * 5e-6 + 7 / 8 * WHOLE / (300e9 * 0.8)  # the ring all-gather of the whole over tp = 8 on NVLink
ST = Strategy(dp=12, tp=8, pp=35, microbatches=160, remat="full")  # MT-NLG on 3360 GPUs, micro-batch 1


def seconds(kind, st=ST):
    return p2p_seconds(Workload(MODEL, 1920, 2048, pipeline_p2p=kind), st, A100)


def test_deepspeed_waits_for_two_blocking_transfers_and_the_tp_gathers_per_pass():
    # forward step: RecvActivation, SendGrad, gather the input; backward step: SendActivation, RecvGrad,
    # gather the stage's own output and the received gradient
    assert seconds("deepspeed") == pytest.approx((2 * TRANSFER + GATHER, 2 * TRANSFER + 2 * GATHER), rel=1e-9)
    assert seconds("deepspeed", replace(ST, sequence_parallel=True)) == seconds("deepspeed")


def test_megatron_scatter_gather_sends_a_slice_and_gathers_it_unless_sequence_parallel():
    assert seconds("scatter-gather") == pytest.approx((TRANSFER + GATHER,) * 2, rel=1e-9)
    assert seconds("scatter-gather", replace(ST, sequence_parallel=True)) == pytest.approx((TRANSFER,) * 2, rel=1e-9)


def test_batched_sends_the_tensor_as_the_stage_holds_it():
    assert seconds("batched") == pytest.approx((12e-6 + WHOLE / 20e9,) * 2, rel=1e-9)
    assert seconds("batched", replace(ST, sequence_parallel=True)) == pytest.approx((TRANSFER,) * 2, rel=1e-9)
    interleaved = replace(ST, sequence_parallel=True, schedule="interleaved", virtual_stages=3)
    assert seconds("batched", interleaved) == pytest.approx((3 * TRANSFER,) * 2, rel=1e-9)
    assert seconds("deepspeed", replace(ST, pp=1, dp=420)) == (0.0, 0.0)


def test_the_step_carries_every_micro_batchs_exchanges_and_an_unknown_kind_is_refused():
    t = step_time(Workload(MODEL, 1920, 2048, pipeline_p2p="deepspeed"), ST, A100)
    assert t.pp_comm_s == pytest.approx(160 * (4 * TRANSFER + 3 * GATHER), rel=1e-9)
    with pytest.raises(ValueError, match="pipeline_p2p"):
        seconds("ring")
