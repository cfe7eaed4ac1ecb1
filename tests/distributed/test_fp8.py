"""FP8 linears across layouts (gloo): tp=2 with sequence parallelism quantises exactly as one process does
(amaxes reduced over tp), and fp8 training under dp2 ZeRO-3, tp2+sp, pp2 and ep2 stays close to bf16."""

import contextlib
import io

import pytest
import torch

from tests.helpers import make_config, rel_err


def tp_parity(preset: str, sp: bool) -> dict:
    """The fp8 tiny model (fp32 around its fp8 matmuls) at tp=world size against the whole model on each rank."""
    import torch.distributed as dist

    from threefold.comm import Comm
    from threefold.config import load_config
    from threefold.mesh import Layout, Mesh
    from threefold.models.decoder import build_model
    from threefold.models.decoder_plan import decoder_plan
    from threefold.parallel.fp8 import convert_linears
    from threefold.parallel.tensor import gather_full, gather_vocab
    from threefold.parallel.tensor_plan import parallelize_tensor

    tp = dist.get_world_size()
    mesh = Mesh(Layout(tp=tp), torch.device("cpu"))
    cfg = load_config(None, [f"model.preset={preset}", "precision.compute=fp8", "precision.fp8_linears=all",
                             "precision.fp8_skip_first_last=false"])
    comm = Comm(mesh)
    reference, model = build_model(cfg.model, 0), build_model(cfg.model, 0)
    placements = parallelize_tensor(model, mesh, comm, decoder_plan(cfg.model), sp)
    one = convert_linears(reference, cfg.precision, None, torch.device("cpu"), 32, cfg.model.layers)
    many = convert_linears(model, cfg.precision, comm, torch.device("cpu"), 32, cfg.model.layers)
    gen = torch.Generator().manual_seed(3)
    tokens, targets = torch.randint(0, cfg.model.vocab, (2, 2, 16), generator=gen)
    ref_loss = reference(tokens, targets)
    ref_loss.backward()
    loss = model(tokens, targets)
    loss.backward()
    logits = gather_vocab(model(tokens), comm, cfg.model.vocab).detach()
    grads = gather_full({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, placements, comm)
    errors = {"logits": rel_err(logits, reference(tokens).detach()), "loss": rel_err(loss.detach(), ref_loss.detach())}
    errors.update({n: rel_err(grads[n], p.grad) for n, p in reference.named_parameters() if p.grad is not None})
    return {"errors": errors, "converted": (len(one.converted), len(many.converted))}


@pytest.mark.parametrize("preset,sp", [("tiny", True), ("tiny-llama", False)])
def test_tp_quantises_as_one_process(worlds, preset, sp):
    for r in worlds(2).run(tp_parity, preset, sp):
        assert r["converted"][0] == r["converted"][1] > 0
        worst = max(r["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst


def zero3_fp8_gather(casts: bool) -> dict:
    """dp2 ZeRO-3 with fp8 matmuls and `zero_weight_comm=fp8`: each converted linear's output in one forward
    against its kernel on the whole, never-sharded weight (same input), and the gather's bytes."""
    import torch.distributed as dist

    from threefold.comm import Comm
    from threefold.comm.quantize import BLOCK
    from threefold.config import load_config
    from threefold.mesh import Layout, Mesh
    from threefold.models.decoder import build_model
    from threefold.parallel.fp8 import Fp8Linear, cast_weight_kernels, convert_linears
    from threefold.parallel.zero3 import Zero3

    n = dist.get_world_size()
    mesh = Mesh(Layout(dp=n), torch.device("cpu"))
    cfg = load_config(None, ["model.preset=tiny", *FP8])
    comm = Comm(mesh)
    model = build_model(cfg.model, 0)
    convert_linears(model, cfg.precision, comm, torch.device("cpu"), 32, cfg.model.layers)
    reference = build_model(cfg.model, 0)  # the same initial weights, never sharded
    convert_linears(reference, cfg.precision, None, torch.device("cpu"), 32, cfg.model.layers)
    kernels = cast_weight_kernels(model) if casts else {}
    zero3 = Zero3(model, comm, weight_comm="fp8", matmul_casts=kernels)
    weight_casts = []  # the matmuls' own casts of a weight (none when the gather delivered it)
    for kernel in cast_weight_kernels(model).values():
        def counted(t, dtype, role, dims, dim, kernel=kernel, cast=kernel.cast):
            weight_casts.extend([dims] if role == kernel._role.WEIGHT else [])
            return cast(t, dtype, role, dims, dim)
        kernel.cast = counted
    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            module.register_forward_hook(lambda m, args, y, name=name: seen.update({name: (args[0].detach(),
                                                                                            y.detach())}))
    gen = torch.Generator().manual_seed(3)
    tokens, targets = torch.randint(0, cfg.model.vocab, (2, 2, 16), generator=gen)
    before = comm.traffic.total_bytes("dp", "all_gather")
    with zero3.micro_batch(last=True):
        loss = model(tokens, targets)
        sent = comm.traffic.total_bytes("dp", "all_gather") - before
        loss.backward()
    refs = dict(reference.named_modules())
    equal = {name: torch.equal(y, refs[name].kernel(x, refs[name].weight, refs[name].bias))
             for name, (x, y) in seen.items()}
    theory = 0  # this rank's bytes of one gather of every unit: (n - 1) x what it contributes
    for unit in zero3.units:
        cast = sum(sp.chunk for sp in unit.params if id(sp.full) in kernels)
        rest = sum(sp.chunk for sp in unit.params if id(sp.full) not in kernels)
        blocks = -(-rest // BLOCK)
        theory += (n - 1) * (cast + blocks * BLOCK + 4 * blocks) if unit.params else 0
    return {"equal": equal, "sent": sent, "theory": theory, "cast": len(kernels),
            "weight_casts": len(weight_casts), "finite": all(torch.isfinite(u.grad_flat).all().item() for u in zero3.units), "loss": loss.item()}


def test_zero3_fp8_gather_sends_the_matmul_weights_once(worlds):
    """With fp8 matmuls, ZeRO-3's fp8 gather sends each converted weight as the fp8 its matmul uses (the whole
    tensor's scale): the outputs equal the kernel on the never-sharded weight bit for bit, and the wire carries
    1 byte per weight element (the block-wise format's 4-byte scales only for the norms and biases)."""
    for with_casts, without in zip(*(worlds(2).run(zero3_fp8_gather, c) for c in (True, False))):
        assert with_casts["cast"] > 0 and all(with_casts["equal"].values()), with_casts["equal"]
        assert with_casts["finite"] and with_casts["sent"] == with_casts["theory"]
        assert with_casts["weight_casts"] == 0 and without["weight_casts"] == 2 * with_casts["cast"]
        # the block-wise path casts the dequantized weights again: other fp8 values, other outputs
        assert not any(without["equal"].values()) and without["sent"] > with_casts["sent"]


def block_linears(model) -> tuple[int, int]:
    """(the blocks' linears computing in fp8, all the blocks' linears), counted by type: a plain linear
    converted is an Fp8Linear, a tensor-parallel one carries an Fp8Kernel, stacked experts too."""
    from torch import nn

    from threefold.models.moe import Experts
    from threefold.parallel.fp8 import Fp8Kernel, Fp8Linear
    from threefold.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    fp8 = total = 0
    for name, module in model.named_modules():
        if ".blocks." not in f".{name}" or name.endswith("router"):
            continue
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            total, fp8 = total + 1, fp8 + isinstance(module.kernel, Fp8Kernel)
        elif isinstance(module, Experts):
            total, fp8 = total + 1, fp8 + isinstance(module.linear, Fp8Kernel)
        elif isinstance(module, nn.Linear):
            total, fp8 = total + 1, fp8 + isinstance(module, Fp8Linear)
    return fp8, total


def train_pairs(runs: list[list[str]], out: str) -> list[dict]:
    from threefold.train.trainer import Trainer

    reports = []
    for overrides in runs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            trainer = Trainer(make_config(overrides, out))
            records = trainer.run()
        reports.append({"losses": [r["loss"] for r in records], "stderr": err.getvalue(),
                        "linears": block_linears(trainer.parallel.module)})
    return reports


BASE = ["train.steps=4", "train.global_batch=4", "train.seq_len=16", "train.lr=3e-3", "data.source=stdlib"]
FP8 = ["precision.compute=fp8", "precision.fp8_linears=all", "precision.fp8_skip_first_last=false"]
LAYOUTS = {
    "dp2-zero3": ["model.preset=tiny", "parallel.dp=2", "parallel.zero=3"],
    "dp2-zero3-fp8-gather": ["model.preset=tiny", "parallel.dp=2", "parallel.zero=3", "parallel.zero_weight_comm=fp8"],
    "tp2-sp": ["model.preset=tiny", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["model.preset=tiny", "parallel.pp=2", "train.microbatches=2"],
    "ep2": ["model.preset=tiny-moe", "parallel.dp=2", "parallel.ep=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_trains_close_to_bf16(worlds, tmp_path, layout):
    runs = [BASE + LAYOUTS[layout] + ["precision.compute=bf16"], BASE + LAYOUTS[layout] + FP8]
    for bf16, fp8 in worlds(2).run(train_pairs, runs, str(tmp_path)):
        assert all(torch.isfinite(torch.tensor(fp8["losses"])))
        # fp8_linears=all without skipping the first and last block: every block linear of this rank
        assert fp8["linears"][0] == fp8["linears"][1] > 0, (layout, fp8["linears"])
        assert bf16["linears"] == (0, fp8["linears"][1]), (layout, bf16["linears"])
        assert fp8["losses"] != bf16["losses"]
        worst = max(abs(a - b) / b for a, b in zip(fp8["losses"], bf16["losses"]))
        assert worst < 2e-2, (layout, worst)


def test_resume_under_another_layout(worlds, tmp_path):
    """A tp2+sp fp8 checkpoint (no fp8 state in it) continues under dp2 ZeRO-3 as the tp2 run continued."""
    from threefold.checkpoint.format import step_dir_name

    tp = BASE + LAYOUTS["tp2-sp"] + FP8 + ["checkpoint.save_every=2"]
    first = worlds(2).run(train_pairs, [tp], str(tmp_path / "tp"))[0][0]
    ckpt = tmp_path / "tp" / "checkpoints" / step_dir_name(2)
    names = {p.name for p in ckpt.rglob("*")}
    assert not any("fp8" in n or "amax" in n or "scale" in n for n in names), names
    zero3 = BASE + LAYOUTS["dp2-zero3"] + FP8 + [f"checkpoint.resume={ckpt}"]
    again = worlds(2).run(train_pairs, [zero3], str(tmp_path / "zero3"))[0][0]
    assert len(again["losses"]) == 2
    assert max(abs(a - b) / b for a, b in zip(again["losses"], first["losses"][2:])) < 1e-2


def rows_to_nobody() -> list[float]:
    """all_to_all_v where rank 0 holds no rows at all (its experts got no tokens): it still takes part."""
    import torch.distributed as dist

    from threefold.comm import Comm
    from threefold.mesh import Layout, Mesh

    mesh = Mesh(Layout(dp=dist.get_world_size()), torch.device("cpu"))
    rank = mesh.rank("dp")
    x = torch.zeros(0, 3) if rank == 0 else torch.full((2, 3), 7.0)
    out = torch.empty(1, 3)
    Comm(mesh).all_to_all_v(out, x, [0, 1], [0, 0] if rank == 0 else [1, 1], "dp")
    return out.flatten().tolist()


def test_all_to_all_v_from_a_rank_without_rows(worlds):
    assert worlds(2).run(rows_to_nobody) == [[7.0] * 3, [7.0] * 3]
