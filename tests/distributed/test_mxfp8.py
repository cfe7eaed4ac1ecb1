"""MXFP8 linears across layouts (gloo): dp=2 and tp=2 (+ sequence parallelism) quantise exactly as one
process does, training under dp2 ZeRO-3, tp2+sp, pp2 and ep2 stays close to bf16, and LoRA's adapters
stay bf16."""

import pytest
import torch

from tests.distributed.test_fp8 import BASE, train_pairs
from tests.distributed.test_lora import LORA, TRAIN, adapter_gradients
from tests.hf_tasks import save_tiny
from tests.helpers import rel_err

MX = ["precision.compute=mxfp8", "precision.fp8_linears=all", "precision.fp8_skip_first_last=false"]
# hidden 64: 32 attention features and 64 MLP features per rank at tp=2, whole 32-element blocks
TINY64 = ["model.preset=tiny", "model.hidden=64"]


def one_and_split(layout: str) -> dict:
    """The MXFP8 tiny model (fp32 around its MX matmuls) split over the world (tp, or dp: each rank half the
    batch, gradients summed) against the whole model on the whole batch on each rank."""
    import torch.distributed as dist

    from threefold.comm import Comm
    from threefold.config import load_config
    from threefold.mesh import Layout, Mesh
    from threefold.models.decoder import build_model
    from threefold.models.decoder_plan import decoder_plan
    from threefold.parallel.fp8 import convert_linears
    from threefold.parallel.tensor import gather_full
    from threefold.parallel.tensor_plan import parallelize_tensor

    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(Layout(tp=n) if layout == "tp" else Layout(dp=n), torch.device("cpu"))
    cfg = load_config(None, [*TINY64, *MX])
    comm = Comm(mesh)
    reference, model = build_model(cfg.model, 0), build_model(cfg.model, 0)
    for net in (reference, model):  # 32x32 tiles of the block weights at 2^-8, 1, 2^8: blocks in one row need
        for name, p in net.named_parameters():  # scales 2^16 apart, so a scale over more than a block flushes
            if name.startswith("blocks.") and p.dim() == 2:  # the small ones to e4m3's subnormals
                i, j = torch.arange(p.shape[0]) // 32, torch.arange(p.shape[1]) // 32
                p.data *= torch.exp2(8.0 * ((i[:, None] + j[None, :]) % 3 - 1))
    placements = parallelize_tensor(model, mesh, comm, decoder_plan(cfg.model), True) if layout == "tp" else None
    one = convert_linears(reference, cfg.precision, None, torch.device("cpu"), 64, cfg.model.layers)
    many = convert_linears(model, cfg.precision, comm, torch.device("cpu"), 64, cfg.model.layers)
    gen = torch.Generator().manual_seed(3)
    tokens, targets = torch.randint(0, cfg.model.vocab, (2, 4, 16), generator=gen)
    reference(tokens, targets).backward()
    if layout == "tp":
        model(tokens, targets).backward()
        grads = gather_full({k: p.grad for k, p in model.named_parameters() if p.grad is not None}, placements, comm)
    else:  # 2 sequences x 16 tokens = 32 rows per rank: the weight gradients' blocks along M are the whole run's
        rows = slice(rank * 4 // n, (rank + 1) * 4 // n)
        model(tokens[rows], targets[rows]).backward()
        grads = {}
        for k, p in model.named_parameters():
            if p.grad is None:
                continue
            dist.all_reduce(p.grad)  # the model's loss is summed over tokens: so are its gradients
            grads[k] = p.grad
    errors = {k: rel_err(grads[k], p.grad) for k, p in reference.named_parameters() if p.grad is not None}
    return {"errors": errors, "converted": (len(one.converted), len(many.converted))}


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_quantises_as_one_process(worlds, layout):
    """Every dimension a 32-block runs along is whole on a rank or split at a block boundary, so each rank
    casts the very MX values the one process casts; only the order of fp32 sums differs (the tp and dp
    reductions add partial products): 1e-5 per gradient, as for tensorwise fp8's tp parity."""
    for r in worlds(2).run(one_and_split, layout):
        assert r["converted"][0] == r["converted"][1] == 12
        worst = max(r["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst


LAYOUTS = {
    "dp2-zero3": ["model.preset=tiny", "parallel.dp=2", "parallel.zero=3"],
    "tp2-sp": [*TINY64, "parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["model.preset=tiny", "parallel.pp=2", "train.microbatches=2"],
    "ep2": ["model.preset=tiny-moe", "model.expert_ffn_hidden=64", "parallel.dp=2", "parallel.ep=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mxfp8_trains_close_to_bf16(worlds, tmp_path, layout):
    runs = [BASE + LAYOUTS[layout] + ["precision.compute=bf16"], BASE + LAYOUTS[layout] + MX]
    ranks = worlds(2).run(train_pairs, runs, str(tmp_path))
    assert "block linears compute in mxfp8" in ranks[0][1]["stderr"]  # rank 0 prints the line
    for bf16, mx in ranks:
        assert all(torch.isfinite(torch.tensor(mx["losses"]))) and mx["losses"] != bf16["losses"]
        worst = max(abs(a - b) / b for a, b in zip(mx["losses"], bf16["losses"]))
        assert worst < 2e-2, (layout, worst)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")


def test_leaves_lora_adapters_in_bf16(alone, llama, tmp_path):
    """The base projections compute in MXFP8 and keep their adapters; each adapter's weight gradient is a
    bf16 GEMM's of its operands, within bf16's unit roundoff 2^-8 of the exact product."""
    run = adapter_gradients([f"model.preset=hf:{llama}", *TRAIN, *LORA, *MX], str(tmp_path / "run"))
    assert "mxfp8: 14 of 14 block linears compute in mxfp8; 28 LoRA adapter linears stay in bf16" in run["stderr"]
    assert all(t == "Fp8Linear" for n, t in run["types"].items() if n.endswith("_proj"))
    assert len(run["errors"]) == 28 and max(run["errors"].values()) <= 2.0**-8, run["errors"]
