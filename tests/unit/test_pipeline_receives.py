"""Where the runtime posts its receives: all at the step's start on gloo, at their places under NCCL's rules."""

from types import SimpleNamespace

import pytest
import torch

from threefold.data import Batch
from threefold.pipeline.runtime import PipelineRuntime
from threefold.schedules.registry import build_schedule
from threefold.pipeline.stage import Stage

SHAPE = (2, 4, 8)


class _Done:
    def wait(self):
        pass

    def is_completed(self):
        return True


class _LoopbackComm:
    """One pipeline rank alone: every transfer is complete at once (receives leave their buffers as they are)."""

    def __init__(self, rank: int, semantics: str):
        self.semantics = semantics
        self.mesh = SimpleNamespace(rank=lambda axis: rank, device=torch.device("cpu"))

    def batch_send_recv(self, sends, recvs):
        return [_Done() for _ in sends + recvs]


class _Instant:
    meter, side_loss = None, 0.0

    def begin(self, global_tokens):
        pass

    def forward(self, stage, x, targets):
        return (torch.zeros(()) if stage.last else torch.zeros(SHAPE)), None

    def backward(self, stage, state, grad):
        return None if stage.first else torch.zeros(SHAPE)


@pytest.mark.parametrize("semantics", ["native", "nccl"])
def test_gloo_posts_every_receive_first_and_nccl_keeps_the_schedule_order(semantics):
    schedule = build_schedule("1f1b", 2, 4)
    for rank in range(2):
        stages = [Stage(s, range(0), s == 0, s == 1) for s in schedule.stages_of(rank)]
        runtime = PipelineRuntime(schedule, stages, _Instant(), _LoopbackComm(rank, semantics), lambda shape: SHAPE)
        tokens = torch.zeros(SHAPE[:2], dtype=torch.long)
        runtime.forward_backward([Batch(tokens, tokens)] * 4, 1)
        ran = [(e.kind, e.stage, e.mb) for e in runtime.timeline]
        planned = [tuple(a) for a in schedule.ranks[rank]]
        receives = [a for a in planned if a[0].startswith("RECV")]
        assert receives  # both ranks receive something
        if semantics == "native":
            assert ran == receives + [a for a in planned if not a[0].startswith("RECV")]
        else:
            assert ran == planned
