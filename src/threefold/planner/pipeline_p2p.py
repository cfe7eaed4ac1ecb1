"""Pipeline point-to-point: what one micro-batch's exchanges between stages cost a stage.

The software that runs the pipeline decides it (`Workload.pipeline_p2p`, one of workload.PIPELINE_P2P):

- "batched" (threefold, the default): each exchange posts its send and its receive together
  (batch_isend_irecv), so a forward and a backward each wait for one transfer of the stage's
  boundary tensor (b, s, h) as the stage holds it: whole, or 1/tp of it under sequence
  parallelism.
- "scatter-gather" (Megatron-LM of 2021-22, Narayanan et al. 2021, section 4.1; its
  p2p_communication.py with `scatter_gather_tensors_in_pipeline` on by default): batched as
  above, but each tp rank sends only its 1/tp slice of the replicated tensor over its own
  network port, and the receiver all-gathers the slices over tp (NVLink); under sequence
  parallelism the tensor is already 1/tp and nothing is gathered.
- "deepspeed" (DeepSpeed's PipelineEngine, used by Megatron-DeepSpeed for MT-NLG and BLOOM): its
  TrainSchedule runs in lock-step and each step executes its instructions in order with blocking
  calls - a forward step RecvActivation then SendGrad, a backward step SendActivation then RecvGrad
  (deepspeed/runtime/pipe/schedule.py: "The communication is blocking") - so a stage waits for two
  transfers per forward and two per backward, not one. The engine partitions the boundary tensor
  over the tensor-parallel ranks (PartitionedTensor over the slice group: `is_pipe_partitioned`
  and `is_grad_partitioned` whenever tp > 1, deepspeed/runtime/pipe/engine.py), so each transfer is
  1/tp of it, and restores it with all-gathers over tp: the received activation before the
  forward; the stage's own output (freed after sending) and the received gradient before the
  backward. Those gathers run on the compute stream, in the critical path.

Each transfer is alpha + bytes / beta over the link between pipeline neighbours (comm.axis_link).
"""

from __future__ import annotations

from . import comm
from .hardware import Gpu
from .memory import compute_bytes
from .workload import Strategy, Workload

# (transfers, all-gathers over tp) a stage waits for in one micro-batch's forward and its backward
_DEEPSPEED = ((2, 1), (2, 2))


def boundary_bytes(w: Workload, st: Strategy) -> float:
    """The (b, s, h) tensor between two stages, whole (s: the rank's 1/cp of each sequence under cp)."""
    return compute_bytes(st.precision) * st.micro_batch_size(w) * st.local_seq(w) * w.model.hidden


def p2p_seconds(w: Workload, st: Strategy, gpu: Gpu) -> tuple[float, float]:
    """Pipeline communication a stage waits for in one micro-batch's (forward, backward), all its
    interleaved chunks included."""
    if st.pp == 1:
        return 0.0, 0.0
    whole = boundary_bytes(w, st)
    link = comm.axis_link(gpu, "pp", st.tp, st.dp, st.pp, st.cp)
    v = st.virtual
    if w.pipeline_p2p == "batched":
        one = comm.point_to_point(whole / (st.tp if st.sequence_parallel else 1), link)
        return v * one, v * one
    transfer = comm.point_to_point(whole / st.tp, link)
    gather = comm.all_gather(whole, st.tp, comm.axis_link(gpu, "tp", st.tp, st.dp, st.tp))
    if w.pipeline_p2p == "scatter-gather":
        one = transfer + (0.0 if st.sequence_parallel else gather)
        return v * one, v * one
    (ft, fg), (bt, bg) = _DEEPSPEED
    return v * (ft * transfer + fg * gather), v * (bt * transfer + bg * gather)
