"""A stage's backward in two halves: I (the input's gradient) and W (the weights' gradients).

Zero-bubble schedules run I as soon as the next stage's gradient arrives, because the previous
stage waits for its result, and defer W. The method is torch.distributed.pipelining's
(`_backward.stage_backward_input` / `stage_backward_weight`), done with one walk of the graph
per micro-batch instead of one per weight:

* **Analysis.** The nodes from which the stage input is reachable form the input's path.
  Where a weight's branch leaves that path (a node of the path with a child off the path),
  that node is an *intermediate*. Intermediates whose branches share a node form one group.
* **I.** One autograd call computes the input's gradient and the gradients of the vector
  weights (biases, norm scales: cheap to compute, but each group would cost W a call of its
  own). A pre-hook on every intermediate keeps the gradients arriving there (its output
  gradients) for the matrices' groups.
* **W.** Per group, one autograd call starts from those kept gradients at the intermediates
  and asks only for the group's weights, so the engine runs the intermediate for its weight
  outputs and walks the weight branches, nothing of the input's path. The results are added
  into `.grad` as a full backward would (the same values: every node computes what it would in
  one backward, only at another time).

The analysis is a function of the graph's structure only, and every micro-batch of a stage
builds the same structure. `backward_input(..., plans=dict, key=...)` therefore keeps it as
positions in the graph's breadth-first order under `key`, with the graph's exact shape (each
node's class and the positions of its children): a later graph of that shape takes the groups
by position after one cheap walk; any other graph is analysed afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge


@dataclass
class WeightGroup:
    nodes: list  # intermediates: nodes on the input's path with a child on a weight branch
    weights: list[torch.Tensor]  # the weights their branches reach
    leaves: list  # the weights' gradient accumulators, in `weights` order
    grads: list = field(default_factory=list)  # per node: the output gradients kept during I


def _analyse(out: torch.Tensor, inp: torch.Tensor) -> list[WeightGroup]:
    """The weight groups of `out`'s graph above `inp` (see the module docstring)."""
    target = inp.grad_fn if inp.grad_fn is not None else _accumulator(inp)
    children: dict = {}
    order = []  # post-order: every node after its children
    stack = [(out.grad_fn, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
        elif node not in children:
            children[node] = kids = [n for n, _ in node.next_functions if n is not None]
            stack.append((node, True))
            stack.extend((k, False) for k in kids if k not in children)
    on_path = set()
    for node in order:
        if node is target or any(k in on_path for k in children[node]):
            on_path.add(node)
    groups: list[WeightGroup] = []
    owner: dict = {}  # branch node -> index into groups (intermediates sharing a branch merge)
    for node in reversed(order):  # from the output down
        if node not in on_path or node is target:
            continue
        todo = [k for k in children[node] if k not in on_path]
        if not todo:
            continue
        group = WeightGroup([node], [], [])
        branch, seen = [], set()
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                branch.append(n)
                todo.extend(children[n])
        merged = {owner[n] for n in branch if n in owner}
        for index in sorted(merged):
            other = groups[index]
            group.nodes = other.nodes + group.nodes
            for leaf, weight in zip(other.leaves, other.weights):
                group.leaves.append(leaf)
                group.weights.append(weight)
            groups[index] = None
        for n in branch:
            variable = getattr(n, "variable", None)
            if variable is not None and variable.requires_grad and n not in group.leaves:
                group.leaves.append(n)
                group.weights.append(variable)
        groups.append(group)
        for n in list(owner):
            if owner[n] in merged:
                owner[n] = len(groups) - 1
        for n in branch:
            owner[n] = len(groups) - 1
    return [g for g in groups if g is not None and g.weights]


def _walk(out: torch.Tensor) -> tuple[list, dict, tuple]:
    """(nodes in breadth-first order, node -> position, the graph's shape: per node its class and
    its children's positions, -1 for an edge without a node)."""
    root = out.grad_fn
    order, index, shape = [root], {root: 0}, []
    for node in order:  # grows while walking
        kids = []
        for child, _ in node.next_functions:
            if child is None:
                kids.append(-1)
                continue
            position = index.get(child)
            if position is None:
                position = index[child] = len(order)
                order.append(child)
            kids.append(position)
        shape.append((type(node), tuple(kids)))
    return order, index, tuple(shape)


def _planned(out: torch.Tensor, inp: torch.Tensor, plans: dict, key) -> list[WeightGroup]:
    """`_analyse`, reusing the analysis of a graph of the same shape kept in `plans[key]`."""
    order, index, shape = _walk(out)
    target = inp.grad_fn if inp.grad_fn is not None else _accumulator(inp)
    shape = (index.get(target), shape)
    plan = plans.get(key)
    if plan is not None and plan[0] == shape:
        return [WeightGroup([order[i] for i in nodes], [order[j].variable for j in leaves], [order[j] for j in leaves])
                for nodes, leaves in plan[1]]
    groups = _analyse(out, inp)
    plans[key] = (shape, [([index[n] for n in g.nodes], [index[leaf] for leaf in g.leaves]) for g in groups])
    return groups


def _accumulator(t: torch.Tensor):
    return t.view_as(t).grad_fn.next_functions[0][0]


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor, plans: dict | None = None,
                   key=None) -> tuple[torch.Tensor, list]:
    """I: the gradient of `inp` (`out`'s gradient `grad`; None when `out` is the scalar loss) and
    what W needs (the groups hold the graph's nodes they need until W). `plans`: analyses kept
    between calls, under `key` (module docstring)."""
    groups = _analyse(out, inp) if plans is None else _planned(out, inp, plans, key)
    vectors, leaves = [], []
    for group in groups:
        keep = [(w, leaf) for w, leaf in zip(group.weights, group.leaves) if w.dim() >= 2]
        for w, leaf in zip(group.weights, group.leaves):
            if w.dim() < 2:
                vectors.append(w)
                leaves.append(GradientEdge(leaf, 0))
        group.weights, group.leaves = [w for w, _ in keep], [leaf for _, leaf in keep]
    groups = [g for g in groups if g.weights]
    handles = []
    for group in groups:
        group.grads = [None] * len(group.nodes)
        for i, node in enumerate(group.nodes):
            def keep(grad_outputs, group=group, i=i):
                group.grads[i] = grad_outputs
            handles.append(node.register_prehook(keep))
    try:
        dinp, *dvectors = torch.autograd.grad(out, [inp, *leaves], grad, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    _accumulate(vectors, dvectors)
    return dinp, groups


def backward_weight(groups: list[WeightGroup]) -> None:
    """W: add every group's weight gradients into `.grad`; the groups then let go of the graph."""
    for group in groups:
        edges, grads = [], []
        for node, kept in zip(group.nodes, group.grads):
            for i, g in enumerate(kept or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        handles = []
        if len(group.nodes) > 1:  # a node reached from another one of the group keeps its I value
            handles = [node.register_prehook(lambda _, kept=kept: kept)
                       for node, kept in zip(group.nodes, group.grads)]
        try:
            if edges:
                # retain_graph: a group's call may pass through another group's node (a weight used at
                # two places of the path); the graph goes with the last reference to it, after W
                dweights = torch.autograd.grad(edges, [GradientEdge(leaf, 0) for leaf in group.leaves], grads,
                                               retain_graph=True, allow_unused=True)
                _accumulate(group.weights, dweights)
        finally:
            for h in handles:
                h.remove()
        group.nodes, group.grads = [], []


def _accumulate(weights: list[torch.Tensor], grads) -> None:
    """Add into `.grad` as autograd's accumulation does (the first gradient is taken as it is)."""
    for weight, dw in zip(weights, grads):
        if dw is None:
            continue
        if weight.grad is None:
            weight.grad = dw
        else:
            weight.grad += dw
