"""The Mesh's lanes: a second process group over an axis's ranks, created by every rank in one order."""

import torch


def lanes(layouts: list[dict]) -> list[dict]:
    """Per layout: the rank lists every new group was created with while the lanes were added (the
    group cache emptied first, restored after), the lane groups' ranks, and a sum over each lane."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from threefold import mesh as mesh_module
    from threefold.mesh import GATHER, Layout, Mesh

    out = []
    for layout in layouts:
        saved = dict(mesh_module._GROUPS)
        mesh_module._GROUPS.clear()  # a layout built earlier in this world would reuse its groups
        m = Mesh(Layout(**layout), torch.device("cpu"))
        created: list[list[int]] = []
        new_group = c10d.new_group

        def spy(ranks=None, *args, **kwargs):
            created.append(list(ranks))
            return new_group(ranks, *args, **kwargs)

        c10d.new_group = spy
        try:
            missing = _error(lambda: m.group("dp", GATHER))
            axes = ["dp"] + (["edp"] if layout.get("ep", 1) > 1 else [])
            for axis in axes:
                m.add_lane(axis, GATHER)
                m.add_lane(axis, GATHER)  # once per Mesh: no second set of groups
            again = Mesh(Layout(**layout), torch.device("cpu"))
            for axis in axes:
                again.add_lane(axis, GATHER)  # the same layout in the same world: the cached groups
        finally:
            c10d.new_group = new_group
            mesh_module._GROUPS.clear()
            mesh_module._GROUPS.update(saved)
        report = {"created": created, "missing": missing, "tp": _error(lambda: m.add_lane("tp", GATHER))}
        for axis in axes:
            lane = m.group(axis, GATHER)
            value = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(value, group=lane)
            report[axis] = {"lane": dist.get_process_group_ranks(lane), "ranks": m.ranks(axis),
                            "distinct": lane is not m.group(axis), "same_again": again.group(axis, GATHER) is lane,
                            "sum": value.item()}
        out.append(report)
    return out


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def test_lanes_are_second_groups_over_the_same_ranks_created_alike_on_every_rank(worlds):
    layouts = [{"dp": 2, "tp": 2}, {"dp": 4, "ep": 2}]
    reports = worlds(4).run(lanes, layouts)
    expected = [[[0, 2], [1, 3]], [[0, 1, 2, 3], [0, 2], [1, 3]]]  # dp groups over tp=2; dp, then edp groups
    for i, want in enumerate(expected):
        for rank, rep in enumerate(r[i] for r in reports):
            assert rep["created"] == want, (layouts[i], rank, rep["created"])
            assert "add_lane" in rep["missing"] and "lanes are" in rep["tp"]
            for axis in ("dp", "edp") if i else ("dp",):
                got = rep[axis]
                assert got["lane"] == got["ranks"] and rank in got["lane"] and got["distinct"] and got["same_again"]
                assert got["sum"] == sum(got["ranks"]), (axis, got)
