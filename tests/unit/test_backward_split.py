"""The input/weight split of a stage's backward (pipeline/backward_split.py) against plain autograd."""

import torch
from torch import nn

from threefold.pipeline.backward_split import backward_input, backward_weight


def _stage():
    torch.manual_seed(0)
    # `w` sits at two places of the input's path: its two branches share its accumulator, so
    # the two nodes form one group, and the upper one's W call passes through the lower one
    w, b = nn.Parameter(torch.randn(8, 8) / 3), nn.Parameter(torch.randn(8))
    norm = nn.LayerNorm(8)
    params = [w, b, norm.weight, norm.bias]

    def forward(x):
        return norm(torch.tanh(x @ w.T + b)) @ w.T

    return forward, params


def test_split_backward_equals_one_backward_with_a_weight_used_twice():
    forward, params = _stage()
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    reference = []
    for micro in range(2):  # two micro-batches: W adds into the gradients the first one left
        inp = (x + micro).requires_grad_()
        forward(inp).backward(grad)
        reference.append(inp.grad.clone())
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    for micro in range(2):
        inp = (x + micro).requires_grad_()
        dinp, groups = backward_input(forward(inp), grad, inp)
        assert torch.equal(dinp, reference[micro])
        if micro == 0:  # I takes the vectors (bias, norm scale) along; the matrix waits for W
            assert params[0].grad is None and all(p.grad is not None for p in params[1:])
        backward_weight(groups)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-7)


def test_split_backward_of_a_scalar_loss():
    forward, params = _stage()
    x = torch.randn(4, 8)
    forward(x.requires_grad_()).square().sum().backward()
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    inp = x.detach().requires_grad_()
    dinp, groups = backward_input(forward(inp).square().sum(), None, inp)
    backward_weight(groups)
    torch.testing.assert_close(dinp, x.grad)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-7)


def _groups(groups):
    return [(g.nodes, g.leaves, [id(w) for w in g.weights]) for g in groups]


def test_a_kept_analysis_serves_graphs_of_its_shape_only():
    from threefold.pipeline.backward_split import _analyse, _planned

    forward, params = _stage()
    plans, x = {}, torch.randn(4, 8)
    for micro in range(2):  # the second graph takes the kept analysis: the same groups as a fresh one
        inp = (x + micro).requires_grad_()
        out = forward(inp)
        assert _groups(_planned(out, inp, plans, "stage")) == _groups(_analyse(out, inp))
    # another graph under the same key (the weight used once more): analysed afresh, not by position
    inp = x.clone().requires_grad_()
    out = forward(inp) @ params[0].T
    assert _groups(_planned(out, inp, plans, "stage")) == _groups(_analyse(out, inp))


def test_split_backward_with_kept_analyses_equals_one_backward():
    forward, params = _stage()
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    for micro in range(3):
        forward((x + micro).requires_grad_()).backward(grad)
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    plans = {}
    for micro in range(3):
        inp = (x + micro).requires_grad_()
        _, groups = backward_input(forward(inp), grad, inp, plans, 0)
        backward_weight(groups)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-7)
