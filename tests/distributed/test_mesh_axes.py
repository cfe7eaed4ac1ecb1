"""Axes are data: the cp axis, role queries, and one collective over several axes (dp x cp)."""

import torch


def axes_report(layout: dict) -> dict:
    import torch.distributed as dist

    from threefold.comm import Comm
    from threefold.mesh import BATCH, GATHER, PIPELINE, REPLICA, SEQUENCE, TENSOR, Layout, Mesh

    m = Mesh(Layout(**layout), torch.device("cpu"))
    comm = Comm(m)
    replica = m.axes_where(REPLICA)
    joined = m.axis_over(replica)
    out = {"names": [a.name for a in m.axes], "replica": replica, "batch_seq": m.axes_where(BATCH, SEQUENCE),
           "tensor_pipeline": m.axes_where(TENSOR, PIPELINE), "joined": joined,
           "coords": {a: m.rank(a) for a in ("pp", "dp", "cp", "tp", joined)},
           "ranks": {a: m.ranks(a) for a in ("pp", "dp", "cp", "tp", joined)},
           "size": m.size(joined), "group_over": dist.get_process_group_ranks(m.group_over(replica))}
    # one all-reduce over dp and cp together: one record, one group, its bytes under the joined name
    t = torch.tensor([float(dist.get_rank() + 1), 10.0 * dist.get_rank()])
    before = len(comm.records)
    comm.all_reduce_over(t, replica)
    out["sum"] = t.tolist()
    out["records"] = [(r.op, r.axis, r.group) for r in list(comm.records)[before:]]
    # reduce-scatter and all-gather over the joined axis (ZeRO's pair): chunk i to joined coordinate i
    n = m.size(joined)
    src = torch.arange(2.0 * n) + 100 * dist.get_rank()
    piece = torch.empty(2)
    comm.reduce_scatter_over(piece, src, replica)
    whole = torch.empty(2 * n)
    comm.all_gather_over(whole, piece, replica)
    out["piece"], out["whole"] = piece.tolist(), whole.tolist()
    m.add_lane(joined, GATHER)  # ZeRO-3's gathers run on a lane of the replica axis
    lane = m.group(joined, GATHER)
    out["lane"] = (dist.get_process_group_ranks(lane), lane is not m.group(joined))
    out["bytes"] = {axis: dict(ops) for axis, ops in comm.traffic.total.items()}
    out["again"] = Mesh(Layout(**layout), torch.device("cpu")).group(joined) is m.group(joined)  # cached
    return out


def test_cp_axis_roles_and_one_collective_over_dp_and_cp(worlds):
    reports = worlds(4).run(axes_report, {"dp": 2, "cp": 2})
    world_sum = [1.0 + 2 + 3 + 4, 10.0 * (0 + 1 + 2 + 3)]
    for rank, rep in enumerate(reports):
        assert rep["names"] == ["pp", "dp", "cp", "tp"]
        assert rep["replica"] == ("dp", "cp") and rep["batch_seq"] == ("dp", "cp")
        assert rep["tensor_pipeline"] == ("pp", "tp")
        assert rep["joined"] == "dp+cp" and rep["size"] == 4
        # order pp, dp, cp, tp: cp is inner to dp, so cp ranks are consecutive
        assert rep["coords"] == {"pp": 0, "dp": rank // 2, "cp": rank % 2, "tp": 0, "dp+cp": rank}
        assert rep["ranks"]["cp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert rep["ranks"]["dp"] == [rank % 2, rank % 2 + 2]
        assert rep["ranks"]["dp+cp"] == rep["group_over"] == [0, 1, 2, 3]
        assert rep["sum"] == world_sum  # the sum over the 4 ranks, in one collective
        assert rep["records"] == [("all_reduce", "dp+cp", (0, 1, 2, 3))]
        # reduce-scatter: rank r keeps elements 2r, 2r+1 summed over ranks (+100 * (0+1+2+3) each)
        assert rep["piece"] == [4.0 * (2 * rank) + 600, 4.0 * (2 * rank + 1) + 600]
        assert rep["whole"] == [4.0 * i + 600 for i in range(8)]
        assert rep["lane"] == ([0, 1, 2, 3], True) and rep["again"]
        # all_reduce of 2 fp32 elements over 4: 2 (S - chunk) = 2 * (8 - 4 or 0) bytes
        chunk = 4 if rank < 2 else 0
        assert rep["bytes"] == {"dp+cp": {"all_reduce": 2 * (8 - chunk), "reduce_scatter": 24, "all_gather": 24}}


def test_at_cp_1_the_replica_axis_is_dp_and_bytes_keep_their_name(worlds):
    reports = worlds(4).run(axes_report, {"dp": 2, "tp": 2})
    for rank, rep in enumerate(reports):
        assert rep["joined"] == "dp" and rep["size"] == 2
        assert rep["ranks"]["dp"] == rep["group_over"] == [rank % 2, rank % 2 + 2]
        assert rep["records"] == [("all_reduce", "dp", tuple(rep["ranks"]["dp"]))]
        assert set(rep["bytes"]) == {"dp"}
