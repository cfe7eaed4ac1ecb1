"""Activation checkpointing: identical results, and saved-activation bytes exactly as each policy promises."""

import pytest
import torch

from tests.helpers import make_config
from threefold.config import RematConfig
from threefold.errors import ConfigError
from threefold.models.decoder import build_model
from threefold.observe.memory import SavedTensorMeter
from threefold.parallel.remat import ActivationOffload, apply_remat, blocks_of

B, S = 2, 32
CFG = make_config(["model.preset=tiny", "model.layers=4"], "unused").model
H, L = CFG.hidden, CFG.layers


def run(policy: RematConfig | None):
    """Loss, gradients and saved-activation bytes of one forward/backward."""
    model = build_model(CFG, seed=0)
    if policy is not None:
        apply_remat(model, policy)
    tokens = torch.randint(0, CFG.vocab, (B, S), generator=torch.Generator().manual_seed(1))
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter.measure():
        loss = model(tokens, tokens)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, meter.current


def saved_bytes(model, fn, *leaves) -> int:
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter.measure():
        fn(*leaves)
    return meter.current


@pytest.fixture(scope="module")
def baseline():
    return run(None)


@pytest.mark.parametrize("policy", [RematConfig("full"), RematConfig("selective"), RematConfig("every-k", every=2),
                                    RematConfig("selective", targets="attn.core,mlp")])
def test_checkpointing_gives_identical_results(baseline, policy):
    loss, grads, _ = run(policy)
    ref_loss, ref_grads, _ = baseline
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_saved_activation_bytes_fall_as_promised(baseline):
    none = baseline[2]
    model = build_model(CFG, seed=0)
    x_bytes = B * S * H * 4
    block = saved_bytes(model, model.blocks[0], torch.randn(B, S, H, requires_grad=True))  # its input included
    attn = model.blocks[0].attn
    qkv = [torch.randn(B, S, H, requires_grad=True) for _ in range(3)]
    heads = [t.unflatten(-1, (-1, attn.head_dim)).transpose(1, 2) for t in qkv]  # as in the model
    core = saved_bytes(model, attn.core, *heads)  # its inputs q, k, v included
    full, every2, selective = (run(p)[2] for p in (RematConfig("full"), RematConfig("every-k", every=2),
                                                   RematConfig("selective")))
    # full: of each block only its input is kept
    assert full == none - L * (block - x_bytes)
    # every-k: the same for blocks 0 and 2 of 4
    assert every2 == none - (L // 2) * (block - x_bytes)
    # selective: of each attention core only q, k, v are kept (nothing else saves them); its output
    # stays too when the o projection saves the same storage (SDPA may return a transposed view
    # of a (b, s, h) buffer, then flattening it for o is free). What goes is the core's private
    # state: the log-sum-exp of the fused kernel, the (s x s) probabilities of the math kernel.
    out = attn.core(*heads).detach()
    out_shared = out.transpose(1, 2).is_contiguous()
    private = core - 3 * x_bytes - (x_bytes if out_shared else 0)
    assert private > 0
    assert selective == none - L * private
    assert full < every2 < none and selective < none


def test_remat_policy_errors():
    model = build_model(CFG, seed=0)
    with pytest.raises(ConfigError, match="remat.targets"):
        apply_remat(model, RematConfig("selective", targets="attn.nothing"))
    with pytest.raises(ConfigError, match="blocks"):
        apply_remat(torch.nn.Linear(2, 2), RematConfig("full"))
    with pytest.raises(ConfigError, match="remat.every"):
        make_config(["remat.policy=every-k", "remat.every=0"], "unused").validate(1)
    assert apply_remat(model, RematConfig("none")) == []


def test_a_region_is_wrapped_once():
    """Naming a region twice (or applying a policy again) checkpoints it once, not a region inside itself."""
    model = build_model(CFG, seed=0)
    apply_remat(model, RematConfig("full"))
    apply_remat(model, RematConfig("full"))
    apply_remat(model, RematConfig("selective", targets="attn.core,attn.core"))
    block = model.blocks[0]
    assert block.forward.__wrapped__.__func__ is type(block).forward
    assert block.attn.core.__wrapped__.__func__ is type(block.attn).core


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_selective_uses_the_families_own_names(family, tmp_path):
    """`remat.policy=selective` with no targets recomputes the family's attention (ModelSpec.selective):
    the same loss and gradients bit for bit, fewer saved bytes; a wrong name lists the model's real parts."""
    from tests.hf_tasks import save_tiny
    from threefold.models.registry import hf_spec
    from threefold.models.spec import build_whole

    spec = hf_spec(save_tiny(family, tmp_path / family), seed=0)
    assert spec.selective != ("attn.core",)

    def once(policy):
        model = build_whole(spec)
        regions = apply_remat(model, policy, spec.selective) if policy else []
        tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))
        meter = SavedTensorMeter(exclude=list(model.parameters()))
        with meter.measure():
            loss = model(tokens, tokens)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, meter.current, \
            regions

    loss0, grads0, bytes0, _ = once(None)
    loss1, grads1, bytes1, regions = once(RematConfig("selective"))
    assert len(regions) == 2 and all(r.endswith(spec.selective[0]) for r in regions)
    assert torch.equal(loss0, loss1) and grads0.keys() == grads1.keys()
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    assert bytes1 < bytes0
    with pytest.raises(ConfigError) as e:
        apply_remat(build_whole(spec), RematConfig("selective", targets="attn.core"), spec.selective)
    assert spec.selective[0] in str(e.value) and "mlp" in str(e.value)


# ------------------------------------------------------------------ activation offload (remat.offload=cpu)


class _Recording(ActivationOffload):
    """The offload, with the order of block backward starts and copies back recorded."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.log: list[tuple[str, int]] = []

    def _start(self, window):
        self.log.append(("start", window.block))
        super()._start(window)

    def _fetch(self, window):
        self.log.append(("back", window.block))
        super()._fetch(window)


def offloaded_run(policy: RematConfig):
    model = build_model(CFG, seed=0)
    apply_remat(model, policy)
    offload = _Recording()
    for index, _, block in blocks_of(model):
        block.forward = offload.wrap(index, block, block.forward)
    tokens = torch.randint(0, CFG.vocab, (B, S), generator=torch.Generator().manual_seed(1))
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter.measure():
        loss = model(tokens, tokens)
    held = offload.host_bytes
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, meter.current, held, offload


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_offload_moves_the_block_saves_and_brings_them_back_ahead(policy):
    plain = run(RematConfig(policy=policy))
    loss, grads, device, held, offload = offloaded_run(RematConfig(policy=policy, offload="cpu"))
    assert torch.equal(loss, plain[0]) and all(torch.equal(grads[n], plain[1][n]) for n in plain[1])
    assert held > 0 and device == plain[2] - held  # the hooks moved exactly what the meter no longer sees
    assert offload.host_bytes == 0 and offload.times.bytes_to_device == offload.times.bytes_to_host == held
    # each block's backward starts with its copies already back: prefetched when the block after it started
    assert offload.log == [("start", 3), ("back", 3), ("back", 2), ("start", 2), ("back", 1), ("start", 1),
                           ("back", 0), ("start", 0)]


def test_offload_keeps_parameters_and_moves_shared_storages_once():
    lin = torch.nn.Linear(8, 8)
    offload = ActivationOffload(torch.device("cpu"))
    fn = offload.wrap(0, lin, lambda x: lin(x).view(2, 2, 8).transpose(0, 1).sin().sum())
    x = torch.randn(4, 8, requires_grad=True)
    y = fn(x)  # linear saves x (and its weight: a parameter, not moved); sin saves a transposed view
    assert offload.host_bytes == x.untyped_storage().nbytes() + 4 * 8 * 4
    y.backward()
    grad = x.grad.clone()
    x.grad = None
    lin(x).view(2, 2, 8).transpose(0, 1).sin().sum().backward()
    assert torch.equal(x.grad, grad)


@pytest.mark.parametrize("overrides, key", [(["train.compile=true"], "remat.offload"),
                                            (["parallel.pp=2", "pipeline.schedule=pipedream-2bw"], "remat.offload"),
                                            (["remat.offload_blocks=2"], "remat.offload_blocks"),
                                            (["remat.offload_blocks=1-0"], "remat.offload_blocks"),
                                            (["remat.offload_blocks=a"], "remat.offload_blocks")])
def test_offload_refusals_name_the_key(overrides, key):
    world = 2 if "parallel.pp=2" in overrides else 1
    with pytest.raises(ConfigError) as e:
        make_config(["model.layers=2", "remat.offload=cpu", *overrides], "unused").validate(world)
    assert str(e.value).startswith(f"{key}:") and "\n" not in str(e.value)
