"""LoRA on a Hugging Face Llama (parallel/lora.py): threefold's adapters trained under several layouts
against `peft`'s own model (get_peft_model on from_pretrained, the same initial adapter values, a plain
torch AdamW loop over the same batches); the frozen base stays bitwise where it was; the optimizer holds
adapter states only (12 bytes per adapter element in fp32 AdamW, divided over dp under ZeRO)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import make_config, rel_err

pytest.importorskip("peft")

from tests.hf_tasks import TRAIN, save_tiny, train_hf  # noqa: E402

LORA = ["model.lora_rank=4", "model.lora_alpha=8", "train.steps=3", "train.lr=0.01"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")


def ours_of(peft_name: str) -> str:
    """peft's `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` -> threefold's name."""
    name = peft_name.removeprefix("base_model.model.").replace(".default.", ".")
    for pattern, ours in ((r"^model\.layers\.(\d+)\.", r"blocks.\1.layer."), (r"^model\.embed_tokens\.", "embed."),
                          (r"^model\.norm\.", "norm."), (r"^lm_head\.", "head.")):
        name = re.sub(pattern, ours, name)
    return name


def peft_training(directory, overrides: list[str]) -> dict:
    """peft's LoRA model trained by a plain loop, its adapters started from threefold's initial values."""
    import peft
    import transformers

    from threefold.data import Sampler, load_tokens
    from threefold.parallel.lora import DEFAULT_TARGETS, adapter_init

    cfg = make_config(overrides, "unused")
    t, m = cfg.train, cfg.model
    with contextlib.redirect_stderr(io.StringIO()):
        base = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=0.0,
                                                      target_modules=list(DEFAULT_TARGETS)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(adapter_init(ours_of(name), tuple(p.shape), t.seed))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                  weight_decay=t.weight_decay)
    sampler = Sampler(load_tokens(cfg.data.source, cfg.model.vocab, t.seed), t.seq_len, t.global_batch, t.seed)
    losses = []
    for step in range(t.steps):
        (batch,) = sampler.microbatches(step, 1)
        loss = F.cross_entropy(model(input_ids=batch.inputs).logits.flatten(0, 1), batch.targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, t.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
    params = {ours_of(n): p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "initial": {ours_of(n): p for n, p in initial.items()},
            "model": model}


def _base_key(name: str) -> str:
    return name.replace(".base_layer.", ".")


def check_parity(result: dict, reference: dict, what: str) -> None:
    losses = [abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"])]
    assert len(losses) == 3 and max(losses) <= 1e-5, f"{what}: losses differ by {max(losses):.2e}"
    ref = {_base_key(n): p for n, p in reference["params"].items()}
    assert set(result["params"]) == set(ref), f"{what}: {set(result['params']) ^ set(ref)}"
    errors = {n: rel_err(p, ref[n]) for n, p in result["params"].items()}
    worst = max((e, n) for n, e in errors.items())
    assert worst[0] <= 1e-5, f"{what}: {worst[1]} differs by {worst[0]:.2e}"
    initial = {_base_key(n): p for n, p in reference["initial"].items()}
    for name, p in result["params"].items():
        if "lora_" not in name:  # frozen: exactly the pretrained value
            assert torch.equal(p, initial[name]), f"{what}: frozen {name} moved"
    moved = min(rel_err(ref[n], initial[n]) for n in ref if "lora_B" in n)
    assert moved > 1e-2, f"{what}: the adapters did not train"


def train_runs(runs: list[tuple[list[str], str]]) -> list[dict]:
    return [train_hf(overrides, out) for overrides, out in runs]


def test_lora_single_process_matches_peft(worlds, llama, tmp_path):
    base = [f"model.preset=hf:{llama}", *TRAIN, *LORA]
    reference = peft_training(llama, base)
    (result,) = worlds(1).run(train_runs, [(base, str(tmp_path / "111"))])[0]
    check_parity(result, reference, "(1,1,1)")


LAYOUTS2 = {"(1,1,2)": ["parallel.pp=2", "train.microbatches=2", "pipeline.schedule=gpipe"],
            "(2,1,1) ZeRO-1": ["parallel.dp=2", "parallel.zero=1"]}
LAYOUTS4 = {"(2,2,1)": ["parallel.dp=2", "parallel.tp=2"],
            "(2,2,1) ZeRO-3": ["parallel.dp=2", "parallel.tp=2", "parallel.zero=3"]}


@pytest.fixture(scope="module")
def reference(llama):
    return peft_training(llama, [f"model.preset=hf:{llama}", *TRAIN, *LORA])


@pytest.mark.parametrize("size,layouts", [(2, LAYOUTS2), (4, LAYOUTS4)])
def test_lora_layouts_match_peft(worlds, llama, reference, tmp_path, size, layouts):
    base = [f"model.preset=hf:{llama}", *TRAIN, *LORA]
    runs = [(base + o, str(tmp_path / str(i))) for i, o in enumerate(layouts.values())]
    for rank_results in worlds(size).run(train_runs, runs):
        for what, result in zip(layouts, rank_results):
            check_parity(result, reference, what)


def optimizer_bytes(runs: list[tuple[list[str], str]]) -> list[dict]:
    """Per run: this rank's optimizer state bytes (fp32 masters + AdamW moments) and what it updates."""
    from threefold.train.trainer import Trainer

    out = []
    for overrides, directory in runs:
        with contextlib.redirect_stderr(io.StringIO()):
            trainer = Trainer(make_config(overrides, directory))
        state = trainer.optimizer.state_tensors()
        out.append({"bytes": sum(t.numel() * t.element_size() for t in state),
                    "updated": sorted({piece.name for piece in trainer.optimizer.pieces}),
                    "grad_bytes": sum(t.numel() * t.element_size() for t in trainer.parallel.grad_sync.gradient_tensors())})
    return out


def test_lora_optimizer_holds_adapter_states_only(worlds, llama, tmp_path):
    """12 bytes per adapter element (fp32 master + two fp32 moments, bf16 compute), this rank's share under
    ZeRO; nothing for the frozen base. The tiny Llama: 2 layers x r (in + out) of its 7 projections."""
    h, f, kv, r = 64, 128, 32, 4
    adapters = 2 * r * ((h + h) * 2 + (h + kv) * 2 + (h + f) * 3)
    base = [f"model.preset=hf:{llama}", *TRAIN, *LORA, "precision.compute=bf16"]
    runs = {0: ["parallel.dp=2"], 1: ["parallel.dp=2", "parallel.zero=1"], 3: ["parallel.dp=2", "parallel.zero=3"]}
    results = worlds(2).run(optimizer_bytes, [(base + o, str(tmp_path / str(z))) for z, o in runs.items()])
    for rank_results in results:
        for zero, result in zip(runs, rank_results):
            share = adapters if zero == 0 else adapters // 2
            assert result["bytes"] == 12 * share, f"ZeRO-{zero}: {result['bytes']} bytes, not 12 x {share}"
            assert all("lora_" in name for name in result["updated"]), result["updated"]
            if zero == 0:  # every adapter whole, and gradients (bf16) for the adapters only
                assert len(result["updated"]) == 2 * 7 * 2
                assert result["grad_bytes"] == 2 * adapters


def test_lora_checkpoint_and_exports(worlds, llama, tmp_path):
    """A (2,2,1) LoRA run's checkpoint holds the adapters and names the base; `ckpt export --hf` merged opens
    in transformers, `--lora adapter` in peft, both giving the trained model's logits (1e-5)."""
    import peft
    import transformers
    from safetensors import safe_open

    from threefold.checkpoint.format import read_manifest
    from threefold.checkpoint.hf import export_hf
    from threefold.cli import main

    tokens = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(3))
    run = [f"model.preset=hf:{llama}", *TRAIN, *LORA, "parallel.dp=2", "parallel.tp=2", "checkpoint.save_every=3"]
    results = worlds(4).run(train_hf, run, str(tmp_path / "run"), tokens)
    trained = results[0]["after"]
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000003"
    manifest = read_manifest(ckpt)
    model = [n for n in manifest.tensors if n.startswith("model/")]
    assert len(model) == 2 * 7 * 2 and all("lora_" in n for n in model), model
    assert manifest.extra["lora_base"]["source"] == str(llama) and manifest.extra["lora_base"]["fingerprint"]

    export_hf(ckpt, tmp_path / "merged")
    with contextlib.redirect_stderr(io.StringIO()):
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(merged(input_ids=tokens).logits, trained) <= 1e-5

    assert main(["ckpt", "export", str(tmp_path / "run"), "--hf", str(tmp_path / "adapter"), "--lora", "adapter"]) == 0
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 2 * 7 * 2
    with contextlib.redirect_stderr(io.StringIO()):
        base = transformers.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(base(input_ids=tokens).logits, trained) > 1e-3  # the adapters changed the model
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
        assert rel_err(loaded(input_ids=tokens).logits, trained) <= 1e-5


def test_lora_resume_continues_as_one_run(worlds, llama, tmp_path):
    """2 steps, saved (adapters + their ZeRO-1 optimizer shards), resumed for the 3rd: peft's 3-step run."""
    base = [f"model.preset=hf:{llama}", *TRAIN, *LORA, "parallel.dp=2", "parallel.zero=1"]
    reference = peft_training(llama, base)
    out = str(tmp_path / "run")
    worlds(2).run(train_hf, base + ["train.steps=2", "checkpoint.save_every=2"], out)
    results = worlds(2).run(train_hf, base + ["checkpoint.resume=auto"], out)
    ref = {_base_key(n): p for n, p in reference["params"].items()}
    for result in results:
        assert len(result["losses"]) == 1 and abs(result["losses"][0] - reference["losses"][2]) <= 1e-5 * abs(
            reference["losses"][2])
        worst = max((rel_err(p, ref[n]), n) for n, p in result["params"].items())
        assert worst[0] <= 1e-5, f"resumed: {worst[1]} differs by {worst[0]:.2e}"


@pytest.mark.parametrize("overrides, key", [
    (["model.lora_rank=-1"], "model.lora_rank"),
    (["model.lora_rank=4", "model.lora_dropout=1.5"], "model.lora_dropout"),
    (["model.lora_rank=4", "model.lora_alpha=-2"], "model.lora_alpha"),
    (["model.lora_rank=4", "model.lora_targets=q_proj;v"], "model.lora_targets"),
    (["model.lora_alpha=16"], "model.lora_alpha"),  # without a rank: no effect, refused
    (["model.lora_rank=4", "parallel.tp=2", "parallel.sequence_parallel=true"], "model.lora_rank"),
])
def test_lora_bad_settings_are_refused_in_one_line(llama, overrides, key):
    from threefold.config import load_config
    from threefold.errors import ConfigError

    world = 2 if "parallel.tp=2" in overrides else 1
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.preset=hf:{llama}", "train.global_batch=8", *overrides]).validate(world)
    assert str(e.value).startswith(f"{key}:") and "\n" not in str(e.value)


def test_lora_refuses_the_reference_decoder_and_unknown_targets(alone, llama, tmp_path):
    from threefold.config import load_config
    from threefold.errors import ConfigError
    from threefold.train.trainer import Trainer

    with pytest.raises(ConfigError, match="model.lora_rank: LoRA applies to a Hugging Face model"):
        load_config(None, ["model.lora_rank=4", "train.global_batch=8"]).validate(1)
    with pytest.raises(ConfigError, match="model.lora_targets: qq_proj name no linear layer"):
        Trainer(make_config([f"model.preset=hf:{llama}", *TRAIN, "model.lora_rank=4", "model.lora_targets=qq_proj"],
                            str(tmp_path / "run")))


def test_lora_settings_from_a_peft_config():
    import peft

    from threefold.errors import ConfigError
    from threefold.parallel.lora import lora_settings_from_peft

    keys = lora_settings_from_peft(peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                                                   target_modules=["q_proj", "v_proj"]))
    assert keys == {"model.lora_rank": 8, "model.lora_alpha": 16.0, "model.lora_dropout": 0.05,
                    "model.lora_targets": "q_proj,v_proj"}
    with pytest.raises(ConfigError, match="LoraConfig.use_dora"):
        lora_settings_from_peft(peft.LoraConfig(r=8, use_dora=True, target_modules=["q_proj"]))


def test_lora_planner_counts_adapter_states_only(llama):
    """`threefold plan`'s model states for a LoRA run: the frozen base's parameters, the adapters'
    gradients and 12-byte optimizer states (bf16), sharded by ZeRO as the trainer shards them."""
    from threefold.config import load_config
    from threefold.planner.memory import predict_memory

    h, f, kv, r = 64, 128, 32, 4
    adapters = 2 * r * ((h + h) * 2 + (h + kv) * 2 + (h + f) * 3)
    base_params = 250 * 64 * 2 + 2 * (64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 128 + 2 * 64) + 64
    for zero, dp in [(0, 1), (1, 2), (3, 2)]:
        cfg = load_config(None, [f"model.preset=hf:{llama}", *TRAIN, *LORA, "precision.compute=bf16",
                                 f"parallel.dp={dp}", f"parallel.zero={zero}"]).validate(dp)
        mem = predict_memory(cfg, dp)
        share = dp if zero >= 1 else 1
        assert mem["optimizer"] == 12 * adapters // share
        assert mem["grads"] == 2 * adapters // (dp if zero >= 2 else 1)
        assert mem["params"] == 2 * (base_params + adapters) // (dp if zero >= 3 else 1)


def test_lora_base_reference_refuses_other_weights(llama, tmp_path):
    """The checkpoint's base reference: the same directory fingerprints the same; other weights are refused."""
    import shutil

    from threefold.errors import UserError
    from threefold.parallel.lora import LoraBase, LoraSettings

    settings = LoraSettings(4, 8.0, 0.0, ("q_proj",))
    saved = LoraBase(llama, settings).state_dict()
    LoraBase(llama, settings).load_state_dict(saved)
    other = save_tiny("llama", tmp_path / "other", initializer_range=0.05)
    with pytest.raises(UserError, match="other weights"):
        LoraBase(other, settings).load_state_dict(saved)
    shutil.rmtree(other)


def adapter_gradients(overrides: list[str], out: str) -> dict:
    """Two steps in this process; in the second, each adapter linear's weight gradient against the same
    gradient computed in float64 from the operands its GEMM saw: its input and the gradient at its output,
    captured by hooks (B leaves zero in step 1, so both A's and B's gradients are nonzero in step 2)."""
    from threefold.train.trainer import Trainer

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer = Trainer(make_config(overrides, out))
        trainer.train_one_step()
        model, seen = trainer.parallel.module, {}

        def capture(module, args, output):
            seen[module] = {"x": args[0].detach()}
            output.register_hook(lambda g: seen[module].__setitem__("g", g.detach()))

        adapters = {n: m for n, m in model.named_modules() if n.endswith((".lora_A", ".lora_B"))}
        for module in adapters.values():
            module.register_forward_hook(capture)
        trainer.train_one_step()
    errors = {}
    for name, module in adapters.items():
        x, g = seen[module]["x"], seen[module]["g"]
        want = g.reshape(-1, g.shape[-1]).double().t() @ x.reshape(-1, x.shape[-1]).double()
        errors[name] = rel_err(module.weight.grad.double(), want)
    types = {n: type(m).__name__ for n, m in model.named_modules() if n.endswith(("_proj", ".lora_A", ".lora_B"))}
    return {"errors": errors, "types": types, "stderr": err.getvalue()}


def test_fp8_leaves_lora_adapters_in_bf16(alone, llama, tmp_path):
    """precision.compute=fp8 with every block linear asked for: the base projections compute in fp8 and keep
    their adapters; the adapters' GEMMs stay bf16. Their gradients are a bf16 GEMM's of their operands:
    within bf16's unit roundoff 2^-8 of the exact product (fp32 accumulation, one rounding of the result;
    measured at most 0.2%). Converted to fp8 (e5m2 output gradient, e4m3 input), every adapter is
    1.1-3.9% off."""
    run = adapter_gradients([f"model.preset=hf:{llama}", *TRAIN, *LORA, "precision.compute=fp8",
                             "precision.fp8_linears=all", "precision.fp8_skip_first_last=false"], str(tmp_path / "run"))
    types = run["types"]
    assert sum(t == "Fp8Linear" for t in types.values()) == 2 * 7
    assert all(t == "Fp8Linear" for n, t in types.items() if n.endswith("_proj"))
    assert all(t == "Linear" for n, t in types.items() if not n.endswith("_proj")) and len(types) == 3 * 2 * 7
    assert "fp8: 14 of 14 block linears compute in fp8; 28 LoRA adapter linears stay in bf16" in run["stderr"]
    assert len(run["errors"]) == 28 and max(run["errors"].values()) <= 2.0**-8, run["errors"]
