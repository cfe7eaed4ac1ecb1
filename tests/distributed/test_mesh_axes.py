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


def expert_axes_report(layout: dict) -> dict:
    import torch.distributed as dist

    from threefold.comm import Comm
    from threefold.mesh import GATHER, Layout, Mesh

    m = Mesh(Layout(**layout), torch.device("cpu"))
    comm = Comm(m)
    axis = m.expert_replica_axis
    out = {"axes": m.expert_replica_axes, "axis": axis, "size": m.size(axis), "coord": m.rank(axis),
           "ranks": {a: m.ranks(a) for a in ("dp", "cp", "ep", "edp", axis)},
           "coords": {a: m.rank(a) for a in ("dp", "cp", "ep", "edp")},
           "group": dist.get_process_group_ranks(m.group(axis))}
    t = torch.tensor([float(dist.get_rank() + 1)])
    comm.all_reduce(t, axis)
    out["sum"] = t.item()
    # ZeRO's pair over the experts' axis: chunk i to its coordinate i
    n = m.size(axis)
    piece = torch.empty(1)
    comm.reduce_scatter(piece, torch.arange(float(n)) + 100 * dist.get_rank(), axis)
    out["piece"] = piece.item()
    m.add_lane(axis, GATHER)  # ZeRO-3's expert gathers
    out["lane"] = dist.get_process_group_ranks(m.group(axis, GATHER))
    return out


def test_the_experts_are_summed_over_edp_and_cp_in_one_group(worlds):
    # (dp 2, cp 2, ep 2): global rank 2 dp + cp; edp has one member, so the experts' axis is cp
    for rank, rep in enumerate(worlds(4).run(expert_axes_report, {"dp": 2, "cp": 2, "ep": 2})):
        c = rank % 2
        assert rep["axes"] == ("edp", "cp") and rep["axis"] == "cp" and rep["size"] == 2
        assert rep["ranks"]["ep"] == [c, c + 2] and rep["ranks"]["edp"] == [rank]  # ep: per cp coordinate
        assert rep["ranks"]["cp"] == rep["group"] == rep["lane"] == [rank - c, rank - c + 1]
        assert rep["sum"] == 2 * (rank - c) + 3.0
        assert rep["piece"] == c * 2 + 100.0 * (2 * (rank - c) + 1)
    # (dp 4, cp 2, ep 2): dp coordinate d = 2 edp + ep; the experts' group is edp x cp, one collective
    for rank, rep in enumerate(worlds(8).run(expert_axes_report, {"dp": 4, "cp": 2, "ep": 2})):
        d, c = divmod(rank, 2)
        e, j = divmod(d, 2)
        assert rep["axis"] == "edp+cp" and rep["size"] == 4
        assert rep["coords"] == {"dp": d, "cp": c, "ep": j, "edp": e} and rep["coord"] == 2 * e + c
        assert rep["ranks"]["ep"] == [4 * e + c, 4 * e + 2 + c]
        assert rep["ranks"]["edp"] == [2 * j + c, 2 * j + 4 + c]
        group = [2 * j, 2 * j + 1, 2 * j + 4, 2 * j + 5]
        assert rep["ranks"]["edp+cp"] == rep["group"] == rep["lane"] == group
        assert rep["sum"] == sum(r + 1.0 for r in group)
        assert rep["piece"] == 4 * rep["coord"] + 100.0 * sum(group)
