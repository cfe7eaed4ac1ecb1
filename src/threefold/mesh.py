"""The device mesh: named axes pp x dp x cp x tp over torch's DeviceMesh.

The Mesh is the only owner of process groups. It is built once per job and passed to every
strategy, which asks it for `group("tp")`, `rank("pp")`, `size("dp")`. The axis order puts tp
innermost, so tensor-parallel ranks are consecutive global ranks (the same node under the
usual launchers, where its frequent collectives belong), then cp (context parallelism: its
ranks hold parts of every sequence and exchange keys and values, so they stay close), then dp,
then pp outermost. Its sizes are a `Layout` (layout.py, re-exported here: the one record of the
sizes, which the config's checks, fault injection, checkpoints and the planner read too).

Axes are data. `MESH_AXES` is the ordered tuple of axis descriptions, each a name and its roles:
which axes replicate parameters (`REPLICA`: gradients are summed over them), shard the batch
(`BATCH`) or the sequence (`SEQUENCE`: with BATCH, where the loss and token counts are summed),
split tensors (`TENSOR`), stages (`PIPELINE`). Code names the role, not the axis:
`mesh.axes_where(REPLICA)` is ("dp", "cp"), in axis order. A reduction over several axes is one
collective over one group: `mesh.axis_over(axes)` names it - the one axis of size > 1 when there
is one (so byte counts keep their per-axis names: "dp" at cp = 1), else the joined axis
"dp+cp", whose group (the axes' ranks flattened, later axes inner) the Mesh builds once, cached
like the others, for each role's axes (`JOINED_ROLES`); `size`, `rank`, `ranks`, `group` and
lanes take a joined name as they take an axis.

Expert parallelism (`Layout.ep`) splits dp in two more axes: `ep`, runs of ep consecutive dp
coordinates that share one copy of the experts and exchange tokens by all-to-all, and `edp`,
the dp ranks at the same place of their runs, which hold the same experts and sum their
gradients. With ep = 1, edp is dp. Each (pp, cp, tp) coordinate has its own dp group and so its
own ep and edp groups. Under cp the experts are replicated over cp too, so their gradients are
summed over edp and cp together: `expert_replica_axes` is the replica axes with edp for dp
(("edp", "cp")), `expert_replica_axis` their `axis_over` ("edp" at cp = 1, "cp" when edp has
one member, else the joined "edp+cp", whose group - dp split into edp x ep, ep inner, the ep
coordinate and the other axes outside, edp then cp flattened - the Mesh builds with the expert
axes; it takes lanes like "dp+cp").

A lane is a second process group over the same ranks as an axis (`add_lane`, `group(axis, lane)`):
on NCCL every communicator runs its collectives on a CUDA stream of its own, in issue order, so
traffic on a lane does not queue behind the axis's own (ZeRO-3's parameter gathers on dp's
`gather` lane start while the previous unit's reduce-scatter on dp still runs). ep's `pair` lane
carries the all-to-alls of the backward that dualpipev runs beside a forward (pipeline/runtime.py):
each of the two threads of a pair keeps to its own group, so every group sees one order.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .layout import AXES, Layout


REPLICA = "replica"  # parameters replicated: gradients are summed over it
BATCH = "batch"  # shards the batch: losses and token counts are summed over it
SEQUENCE = "sequence"  # shards every sequence: losses and token counts are summed over it
TENSOR = "tensor"  # splits weights and activations (Megatron)
PIPELINE = "pipeline"  # holds stages


@dataclass(frozen=True)
class Axis:
    """One mesh axis: its name and its roles."""
    name: str
    roles: frozenset[str]


# each axis's roles; cp: parameters replicated, the batch not split
ROLES = {"pp": {PIPELINE}, "dp": {REPLICA, BATCH}, "cp": {REPLICA, SEQUENCE}, "tp": {TENSOR}}
# the axes, outermost first, in layout.py's order (the global rank is their mixed-radix coordinate, tp fastest)
MESH_AXES = tuple(Axis(name, frozenset(ROLES[name])) for name in AXES)
# the axis sets that get one flattened group when more than one of them has size > 1:
# the replica axes (gradient sums) and the batch and sequence axes (loss and token sums)
JOINED_ROLES = ((REPLICA,), (BATCH, SEQUENCE))
JOIN = "+"  # "dp+cp": the name of a joined axis


def axes_where(*roles: str) -> tuple[str, ...]:
    """The names of the axes having any of `roles`, in axis order (outermost first)."""
    return tuple(axis.name for axis in MESH_AXES if axis.roles & set(roles))


NODE_AXES = ("dp_intra", "dp_inter")  # dp split by node, built only when a Mesh is given node_size
# dp split for expert parallelism: `ep` (consecutive dp coordinates sharing the experts, the
# all-to-all group) x `edp` (the dp ranks holding the same experts, which sum their gradients)
EXPERT_AXES = ("ep", "edp")
GATHER = "gather"  # the lane of parameter gathers (ZeRO-3)
PAIR = "pair"  # the lane of the backward's all-to-alls in a dualpipev pair (pipeline/runtime.py)
LANES = (GATHER, PAIR)  # second groups over an axis's ranks (Mesh.add_lane)
LANE_AXES = ("dp", "cp", "edp", "ep")  # the axes that have lanes (and joined axes, such as dp+cp)


def cuda_index(env=os.environ) -> int:
    """This process's GPU among the ones it sees: LOCAL_RANK modulo the visible count.

    A launcher that shows each process every GPU of its node (torchrun) gives index LOCAL_RANK;
    one that shows each task only its own (Slurm `--gpus-per-task=1`, CUDA_VISIBLE_DEVICES per
    rank) gives 0, where cuda:LOCAL_RANK would name a GPU that does not exist. The one place
    threefold picks a device index (the trainer's device, through `pick_device`)."""
    visible = torch.cuda.device_count()
    return int(env.get("LOCAL_RANK") or 0) % visible if visible > 1 else 0


def pick_device(kind: str = "auto") -> torch.device:
    """cuda:`cuda_index()` when CUDA is present (or asked for), else the CPU."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", cuda_index())


def local_world_size() -> int:
    """Processes per node, as the launcher (torchrun, the elastic agent, Slurm) describes it."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or 1)


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the world described by the launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR...).

    A lone process with no launcher becomes a world of one over an in-process store. NCCL
    drives CUDA, gloo the CPU.
    On CUDA the process group is bound to this rank's device (`device_id`): NCCL then creates
    its communicators eagerly - the world's here, every subgroup's when the Mesh creates it, in
    the same order on every rank - instead of at a group's first operation, where a first
    batched send/receive that not every member of the group joins can hang.
    """
    if dist.is_initialized():
        return
    alone = {}
    if "RANK" not in os.environ:  # an in-process store: no port to find, nothing to connect to
        # The process's environment stays as it was: a child it starts later (a `threefold
        # train` from a notebook that called prepare()) must not inherit RANK without MASTER_ADDR.
        alone = dict(store=dist.HashStore(), rank=0, world_size=1)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device, **alone)
    else:
        dist.init_process_group("gloo", timeout=timeout, **alone)


_GROUPS: dict[tuple, tuple] = {}  # (device type, shape, node_size) -> (DeviceMesh, groups, node ranks)
_GROUPS_WORLD: list = []  # the default group the cached groups belong to


def _cached(key: tuple, build):
    """One set of process groups per layout per process: a job builds its Mesh once, but a
    long-lived process (a notebook, a test world) may build many Meshes of the same layout, and
    every new group costs each rank connections and threads that are never returned. Groups are
    reused only within the world they were created in."""
    world = dist.group.WORLD
    if not _GROUPS_WORLD or _GROUPS_WORLD[0] is not world:
        _GROUPS.clear()
        _GROUPS_WORLD[:] = [world]
    if key not in _GROUPS:
        _GROUPS[key] = build()
    return _GROUPS[key]


class Mesh:
    """Process groups and coordinates for the axes pp, dp, cp, tp of the current world.

    With `node_size` (processes per node, launcher order: node i holds global ranks
    i*node_size ..), dp is also split by node into `dp_intra` (this rank's dp peers on its
    node) and `dp_inter` (one dp peer per node with the same intra coordinate), for
    hierarchical collectives (comm/hierarchical.py).
    """

    def __init__(self, layout: Layout, device: torch.device, node_size: int = 0):
        world = dist.get_world_size()
        if layout.world_size != world:
            raise ValueError(f"layout {layout} needs {layout.world_size} processes, the world has {world}")
        self.layout = layout
        self.device = device
        shape = layout.shape
        self.device_mesh, groups = _cached((device.type, shape), lambda: self._build_axes(device, shape))
        self._groups = dict(groups)
        for roles in JOINED_ROLES:  # one flattened group per set of axes reduced together
            joined = self.axis_over(axes_where(*roles))
            if JOIN in joined and joined not in self._groups:
                self._groups[joined] = _cached((device.type, shape, joined),
                                               lambda: self._build_joined(joined.split(JOIN)))
        self._node_ranks: dict[str, list[int]] = {}
        self._expert_ranks: dict[str, list[int]] = {}
        self._lanes: dict[tuple[str, str], dist.ProcessGroup] = {}  # (axis, lane) -> the lane's group
        if layout.cp > 1 and node_size:  # they split dp alone, not all replica axes
            raise ValueError(f"layout {layout}: node axes do not compose with cp > 1 yet")
        if layout.ep > 1:
            expert_groups, expert_ranks = _cached((device.type, shape, "ep", layout.ep),
                                                  lambda: self._build_expert_axes(layout.ep))
            self._groups.update(expert_groups)
            self._expert_ranks.update(expert_ranks)
            joined = self.expert_replica_axis  # the experts' replica axes: edp+cp under cp
            if JOIN in joined:
                self._groups[joined] = _cached((device.type, shape, joined, layout.ep),
                                               lambda: self._build_joined(joined.split(JOIN)))
        if node_size:
            node_groups, node_ranks = _cached((device.type, shape, node_size),
                                              lambda: self._build_node_axes(node_size))
            self._groups.update(node_groups)
            self._node_ranks.update(node_ranks)
        if device.type == "cuda":
            self._connect()

    def _connect(self) -> None:
        """One tiny all-reduce on every group of more than one rank, in axis order on every rank:
        each NCCL communicator exists and has run a collective that all its members joined
        before any point-to-point batch uses it (a first batched p2p must include every member).
        Bookkeeping of the groups, not model traffic: it does not go through Comm."""
        probe = torch.zeros(1, device=self.device)
        for axis in AXES + self._joined() + tuple(self._expert_ranks) + tuple(a for a in NODE_AXES if a in self._node_ranks):
            if self.size(axis) > 1:
                dist.all_reduce(probe, group=self._groups[axis])
        torch.cuda.synchronize(self.device)

    def add_lane(self, axis: str, lane: str) -> None:
        """Create `lane`, a second process group over the same ranks as `axis` (dp, cp, edp, ep or a
        joined axis), for traffic that must not wait behind the axis's own collectives (see the module's text).

        Collective: every rank calls it at the same point (strategies do, while `parallelize` builds
        them), and every rank creates every group of the lane, one per group of the axis, in one
        order; on CUDA the new communicators are created eagerly (the device is bound) and probed
        as `_connect` probes the axes. Once per Mesh and (axis, lane); an axis of one member needs none.
        """
        axis = self._lane_axis(axis, lane)
        if (axis, lane) in self._lanes or self.size(axis) == 1:
            return
        lists = self._axis_rank_lists(axis)
        key = (self.device.type, self.layout.shape,
               self.layout.ep if set(axis.split(JOIN)) & set(EXPERT_AXES) else 1, axis, lane)
        group = _cached(key, lambda: dist.new_subgroups_by_enumeration(lists)[0])
        self._lanes[(axis, lane)] = group
        if self.device.type == "cuda":  # a first collective that every member joins, before any use
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)
            torch.cuda.synchronize(self.device)

    def _lane_axis(self, axis: str, lane: str) -> str:
        if lane not in LANES or (axis not in LANE_AXES and axis not in self._joined()):
            raise ValueError(f"no lane '{lane}' on axis '{axis}': lanes are {LANES}, on the axes {LANE_AXES}")
        return "dp" if axis == "edp" and self.layout.ep == 1 else axis  # without expert parallelism edp is dp

    def _axis_rank_lists(self, axis: str) -> list[list[int]]:
        """The global ranks of every group of `axis` (dp, a joined axis, or ep / edp under expert
        parallelism), in one order."""
        if axis == "dp":
            return self._dp_groups()
        if JOIN in axis or axis == "cp":  # cp alone: the replica axis of a layout with dp = 1 (ZeRO-3's gathers)
            return self._joined_rank_lists(axis.split(JOIN))
        return self._cut_dp(self.layout.ep)[0 if axis == "ep" else 1]

    def _build_expert_axes(self, ep: int) -> tuple[dict, dict]:
        """The ep / edp groups: each dp group cut into runs of ep consecutive coordinates (ep), and
        the members with the same place in their run (edp). A one-member axis gets no group."""
        if self.layout.dp % ep:
            raise ValueError(f"ep={ep} does not divide dp={self.layout.dp}")
        return self._split_dp(ep, ("ep", "edp"), single_groups=False)

    @staticmethod
    def _build_axes(device: torch.device, shape: tuple[int, ...]) -> tuple[DeviceMesh, dict]:
        device_mesh = init_device_mesh(device.type, shape, mesh_dim_names=AXES)
        return device_mesh, {axis: device_mesh.get_group(axis) for axis in AXES}

    def _joined_rank_lists(self, names: list[str]) -> list[list[int]]:
        """The global ranks of every group of the joined axes `names`: the grid's other axes
        outside, the joined ones flattened in axis order (the later inner), so a group's ranks ascend.
        With an expert axis among them (edp+cp) the grid's dp is split into edp x ep (ep inner)."""
        axes, grid = AXES, self.device_mesh.mesh
        if set(names) & set(EXPERT_AXES):
            axes = tuple(a for name in AXES for a in (("edp", "ep") if name == "dp" else (name,)))
            grid = grid.reshape(*(self.size(a) for a in axes))
        dims = [axes.index(name) for name in names]
        others = [d for d in range(len(axes)) if d not in dims]
        grid = grid.permute(*others, *dims)
        return grid.reshape(-1, math.prod(grid.shape[len(others):])).tolist()

    def _build_joined(self, names: list[str]) -> dist.ProcessGroup:
        """This rank's group of the joined axes `names` (every rank creates every group, in one order)."""
        group, _ = dist.new_subgroups_by_enumeration(self._joined_rank_lists(names))
        return group

    def _joined(self) -> tuple[str, ...]:
        return tuple(axis for axis in self._groups if JOIN in axis)

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The axes with their roles, outermost first."""
        return MESH_AXES

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Every axis's name, outermost first (AXES): reductions over the world run them reversed."""
        return AXES

    @staticmethod
    def axes_where(*roles: str) -> tuple[str, ...]:
        """The names of the axes having any of `roles`, in axis order: `mesh.axes_where(REPLICA)`."""
        return axes_where(*roles)

    def axis_over(self, axes: tuple[str, ...] | list[str]) -> str:
        """The one axis a reduction over all of `axes` runs on: the only one of them of size > 1
        (its own name and group), the joined axis "a+b" when several are, the first when none is
        (a trivial axis: the collective costs nothing)."""
        wide = [axis for axis in axes if self.size(axis) > 1]
        if len(wide) <= 1:
            return wide[0] if wide else axes[0]
        return JOIN.join(wide)

    @property
    def replica_axis(self) -> str:
        """The axis gradient syncs run on: `axis_over(axes_where(REPLICA))` ("dp" at cp = 1, else "dp+cp")."""
        return self.axis_over(axes_where(REPLICA))

    @property
    def expert_replica_axes(self) -> tuple[str, ...]:
        """The axes holding the same experts under expert parallelism: the replica axes with edp for dp
        ("edp", "cp")."""
        return tuple("edp" if axis == "dp" else axis for axis in axes_where(REPLICA))

    @property
    def expert_replica_axis(self) -> str:
        """The axis the experts' gradient syncs run on: `axis_over(expert_replica_axes)` ("edp" at cp = 1,
        "cp" when edp has one member, else "edp+cp"); without expert parallelism the replica axis."""
        return self.axis_over(self.expert_replica_axes) if self.layout.ep > 1 else self.replica_axis

    def group_over(self, axes: tuple[str, ...] | list[str]) -> dist.ProcessGroup:
        """The one group of `axes` together (built with the Mesh for each role's axes)."""
        return self.group(self.axis_over(axes))

    def _build_node_axes(self, node_size: int) -> tuple[dict, dict]:
        """The dp_intra / dp_inter groups: dp cut at node boundaries (this node's dp peers) and one
        peer per node with the same place."""
        dp_groups = self._dp_groups()
        first = dp_groups[0]
        intra = sum(1 for r in first if r // node_size == first[0] // node_size)
        for ranks in dp_groups:
            runs = [ranks[i: i + intra] for i in range(0, len(ranks), intra)]
            if len(ranks) % intra or any(len({r // node_size for r in run}) != 1 for run in runs) \
                    or len({run[0] // node_size for run in runs}) != len(runs):
                raise ValueError(f"the dp groups of layout {self.layout} do not split evenly over nodes of "
                                 f"{node_size} processes; use a node size that is a multiple of tp and divides "
                                 "dp x tp (or the reverse)")
        return self._split_dp(intra, ("dp_intra", "dp_inter"), single_groups=True)

    def _dp_groups(self) -> list[list[int]]:
        grid = self.device_mesh.mesh  # global ranks, shape (pp, dp, cp, tp)
        return [grid[p, :, c, t].tolist() for p in range(self.layout.pp) for c in range(self.layout.cp)
                for t in range(self.layout.tp)]

    def _cut_dp(self, run: int) -> tuple[list[list[int]], list[list[int]]]:
        """Every dp group cut into runs of `run` consecutive members, and the members at the same
        place of their runs: the global ranks of every group of the two axes, in one order."""
        dp_groups = self._dp_groups()
        return ([g[i: i + run] for g in dp_groups for i in range(0, len(g), run)],
                [g[i::run] for g in dp_groups for i in range(run)])

    def _split_dp(self, run: int, axes: tuple[str, str], single_groups: bool) -> tuple[dict, dict]:
        """Cut every dp group into runs of `run` consecutive members (axis `axes[0]`) and the members
        at the same place of their runs (`axes[1]`): ({axis: this rank's group}, {axis: its ranks}).
        Every rank creates every group, in one order; with `single_groups` false, an axis of one
        member gets no group."""
        me = dist.get_rank()
        groups, ranks = {}, {}
        for axis, lists in zip(axes, self._cut_dp(run)):
            if single_groups or len(lists[0]) > 1:
                groups[axis], _ = dist.new_subgroups_by_enumeration(lists)
            ranks[axis] = next(members for members in lists if me in members)
        return groups, ranks

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def size(self, axis: str) -> int:
        if JOIN in axis:
            return math.prod(self.size(a) for a in axis.split(JOIN))
        if axis in NODE_AXES:
            return len(self._node_axis(axis))
        if axis in EXPERT_AXES:
            return self.layout.ep if axis == "ep" else self.layout.dp // self.layout.ep
        return getattr(self.layout, axis)

    def rank(self, axis: str) -> int:
        """This process's coordinate along `axis` (0 .. size-1); of a joined axis, the mixed-radix
        coordinate of its parts (the later inner)."""
        if JOIN in axis:
            coord = 0
            for a in axis.split(JOIN):
                coord = coord * self.size(a) + self.rank(a)
            return coord
        if axis in NODE_AXES:
            return self._node_axis(axis).index(dist.get_rank())
        if axis in EXPERT_AXES:
            dp = self.device_mesh.get_local_rank("dp")
            return dp % self.layout.ep if axis == "ep" else dp // self.layout.ep
        return self.device_mesh.get_local_rank(axis)

    def inter_node_axes(self, node_size: int) -> tuple[str, ...]:
        """The axes whose group of this rank holds ranks of more than one node (nodes of
        `node_size` processes in launcher order); their bytes cross the network."""
        if node_size < 1 or node_size >= self.world_size:
            return ()
        axes = AXES + self._joined() + tuple(self._expert_ranks) + tuple(self._node_ranks)
        return tuple(a for a in axes if len({r // node_size for r in self.ranks(a)}) > 1)

    def has_node_axes(self) -> bool:
        return bool(self._node_ranks)

    def _node_axis(self, axis: str) -> list[int]:
        if axis not in self._node_ranks:
            raise ValueError(f"axis '{axis}' exists only on a Mesh built with node_size")
        return self._node_ranks[axis]

    def group(self, axis: str, lane: str = "") -> dist.ProcessGroup:
        """This rank's group along `axis`; with `lane`, the second group over the same ranks that
        `add_lane(axis, lane)` created (for an axis of one member: the axis's own group)."""
        if lane:
            key = (self._lane_axis(axis, lane), lane)
            if key in self._lanes:
                return self._lanes[key]
            if self.size(axis) == 1:
                return self.group(axis)
            raise ValueError(f"axis '{axis}' has no lane '{lane}' yet: every rank calls "
                             f"Mesh.add_lane('{axis}', '{lane}') first")
        if JOIN in axis and axis not in self._groups:
            raise ValueError(f"the Mesh has no group over '{axis}': it joins the axes of one role "
                             f"({', '.join('+'.join(axes_where(*r)) for r in JOINED_ROLES)})")
        if axis in NODE_AXES:
            self._node_axis(axis)  # a clear error when the node axes were not built
        if axis in EXPERT_AXES and axis not in self._groups:
            if axis == "edp" and self.layout.ep == 1:  # without expert parallelism edp is dp
                return self._groups["dp"]
            raise ValueError(f"axis '{axis}' has one member in layout {self.layout}: it has no group")
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this process's group along `axis`, ordered by coordinate."""
        if axis in NODE_AXES:
            return list(self._node_axis(axis))
        if axis in EXPERT_AXES:
            if axis in self._expert_ranks:
                return list(self._expert_ranks[axis])
            return self.ranks("dp") if axis == "edp" else [dist.get_rank()]
        return dist.get_process_group_ranks(self.group(axis))

    def global_rank_of(self, axis: str, index: int) -> int:
        """Global rank of the member with coordinate `index` along `axis` in this process's group."""
        return self.ranks(axis)[index]

    def is_first(self, axis: str) -> bool:
        return self.rank(axis) == 0

    def is_last(self, axis: str) -> bool:
        return self.rank(axis) == self.size(axis) - 1

    def __repr__(self) -> str:
        coords = " ".join(f"{a}={self.rank(a)}/{self.size(a)}" for a in AXES)
        return f"Mesh(rank {self.global_rank}: {coords}, {self.device})"
