"""Checkpoints across layouts (gloo): save at step 10, resume under other world sizes; auto-resume."""

import contextlib
import io

import pytest
import torch

from tests.helpers import make_config, max_rel_err, rel_err
from threefold.checkpoint import verify
from threefold.checkpoint.format import step_dir_name

# eps=1e-6: see test_data_parallel.py (AdamW amplifies rounding noise of ~0 gradients with 1e-8)
BASE = ["model.preset=tiny", "train.steps=20", "train.global_batch=8", "train.seq_len=32", "train.lr=1e-3",
        "train.eps=1e-6"]


def train_task(overrides: list[str], out: str) -> dict:
    """Train (resuming as configured); return losses, final params, where it resumed and stderr."""
    from threefold.train.trainer import Trainer

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer = Trainer(make_config(overrides, out))
        records = trainer.run()
    return {"losses": [r["loss"] for r in records], "rank": trainer.mesh.global_rank,
            "params": {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()},
            "resumed_from": trainer.resumed_from.name if trainer.resumed_from else None, "stderr": err.getvalue()}


@pytest.fixture(scope="module")
def reference(worlds, tmp_path_factory):
    """The uninterrupted 20 steps on dp=2, saving (asynchronously) at steps 10 and 20."""
    out = tmp_path_factory.mktemp("ckpt-ref")
    results = worlds(2).run(train_task, BASE + ["checkpoint.save_every=10", "checkpoint.async_save=true"], str(out))
    assert [r["resumed_from"] for r in results] == [None, None]
    return out, results


def test_same_layout_resume_is_bitwise_identical(worlds, tmp_path, reference):
    out, ref = reference
    ckpt = out / "checkpoints" / step_dir_name(10)
    assert verify(ckpt)[1] == []
    results = worlds(2).run(train_task, BASE + [f"checkpoint.resume={ckpt}"], str(tmp_path))
    for r, rr in zip(results, ref):
        assert r["resumed_from"] == step_dir_name(10)
        assert r["losses"] == rr["losses"][10:], f"rank {r['rank']}: steps 11-20 differ"
        for name, p in rr["params"].items():
            assert torch.equal(r["params"][name], p), f"rank {r['rank']}: {name} differs"


@pytest.mark.parametrize("size", [1, 4])
def test_resume_under_another_world_size(worlds, tmp_path, reference, size):
    out, ref = reference
    ckpt = out / "checkpoints" / step_dir_name(10)
    results = worlds(size).run(train_task, BASE + [f"checkpoint.resume={ckpt}"], str(tmp_path))
    expected = ref[0]
    for r in results:
        assert len(r["losses"]) == 10
        for step, (a, b) in enumerate(zip(r["losses"], expected["losses"][10:]), 11):
            assert abs(a - b) / abs(b) <= 1e-4, f"world {size} rank {r['rank']} step {step}: loss {a} vs {b}"
        err, name = max_rel_err(r["params"], expected["params"])
        assert err <= 1e-4, f"world {size} rank {r['rank']}: {name} differs by {err:.2e}"
    # not a no-op: the checkpoint's step-10 state is far from the initial weights
    initial = worlds(size).run(train_task, BASE + ["train.steps=1"], str(tmp_path / "fresh"))[0]
    assert rel_err(initial["params"]["blocks.0.mlp.up.weight"], expected["params"]["blocks.0.mlp.up.weight"]) > 1e-3


def test_resume_auto_skips_a_corrupt_checkpoint(worlds, tmp_path):
    overrides = BASE + ["train.steps=6", "checkpoint.save_every=3", "checkpoint.keep=2"]
    first = worlds(2).run(train_task, overrides, str(tmp_path))
    ckpts = tmp_path / "checkpoints"
    bad = ckpts / step_dir_name(6) / "rank-00000.safetensors"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    second = worlds(2).run(train_task, overrides + ["checkpoint.resume=auto"], str(tmp_path))
    report = "".join(r["stderr"] for r in second)
    assert "rank-00000.safetensors" in report and "failed verification" in report, report
    for r, f in zip(second, first):
        assert r["resumed_from"] == step_dir_name(3)
        assert r["losses"] == f["losses"][3:]
        assert all(torch.equal(r["params"][k], f["params"][k]) for k in f["params"])
    # the run saved step 6 again, replacing the corrupt one
    assert verify(ckpts / step_dir_name(6))[1] == []
    metrics = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 6


def async_snapshot_task(out: str) -> dict:
    """An async save returns before its snapshot is taken; the next optimizer step waits for it."""
    import threading

    from safetensors.torch import load_file

    import threefold.checkpoint.checkpointer as checkpointer_module
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(BASE + ["train.steps=3", "checkpoint.async_save=true"], out))
    trainer.train_one_step()
    release, real_snapshot = threading.Event(), checkpointer_module.snapshot
    returned_before_snapshot = []

    def held_snapshot(*args, **kwargs):
        returned_before_snapshot.append(release.wait(timeout=30))
        return real_snapshot(*args, **kwargs)

    checkpointer_module.snapshot = held_snapshot
    try:
        trainer.save_checkpoint()  # would deadlock for 30 s if save() waited for the snapshot
        saved = {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()}
        threading.Timer(1.0, release.set).start()  # the snapshot happens while the next step runs...
        trainer.train_one_step()  # ...whose optimizer update must wait for it
        trainer.checkpointer.close()
    finally:
        checkpointer_module.snapshot = real_snapshot
    stored = load_file(f"{out}/checkpoints/{step_dir_name(1)}/rank-00000.safetensors")
    changed = any(not torch.equal(p, saved[n]) for n, p in trainer.parallel.module.named_parameters())
    same = all(torch.equal(stored[f"model/{n}@" + ",".join("0" * p.dim())], p) for n, p in saved.items())
    return {"returned_before_snapshot": returned_before_snapshot, "changed": changed, "same": same}


def test_async_snapshot_overlaps_the_next_step_but_not_its_update(worlds, tmp_path):
    result = worlds(1).run(async_snapshot_task, str(tmp_path))[0]
    assert result["returned_before_snapshot"] == [True]
    assert result["changed"] and result["same"]


def init_from_task(overrides: list[str], out: str) -> dict:
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    return {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()}


def test_run_starts_from_an_exported_model(worlds, tmp_path, reference):
    from safetensors.torch import load_file

    from threefold.checkpoint import export_model

    out, _ = reference
    exported = tmp_path / "model.safetensors"
    export_model(out / "checkpoints" / step_dir_name(10), exported)
    full = load_file(exported)
    for params in worlds(2).run(init_from_task, BASE + [f"checkpoint.init_from={exported}"], str(tmp_path)):
        assert params.keys() == full.keys()
        assert all(torch.equal(params[n], full[n]) for n in full)


def init_then_train_task(overrides: list[str], out: str) -> dict:
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    records = trainer.run()
    trainer.parallel.settle()  # nvme under ZeRO-3: the shards come back from their file
    return {"losses": [r["loss"] for r in records],
            "params": {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()}}


def test_masters_off_the_model_start_from_the_exported_model(worlds, tmp_path, reference):
    """checkpoint.init_from fills the model after the optimizer made its masters: fp32 masters kept apart
    (offload=optimizer on the host, offload=nvme in a file) take the imported values too, so the steps
    continue from the exported model, as the run whose masters share the model's storage does."""
    from threefold.checkpoint import export_model

    out, _ = reference
    exported = tmp_path / "model.safetensors"
    export_model(out / "checkpoints" / step_dir_name(10), exported)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    common = BASE[:1] + ["train.steps=3", "train.global_batch=8", "train.seq_len=32", "train.lr=1e-3",
                         "train.eps=1e-6", f"checkpoint.init_from={exported}"]
    nvme = ["parallel.offload=nvme", f"parallel.offload_dir={scratch}", "parallel.offload_block_mb=0.05"]
    runs = {}
    for name, extra in (("z1", ["parallel.zero=1"]), ("z1-host", ["parallel.zero=1", "parallel.offload=optimizer"]),
                        ("z3", ["parallel.zero=3"]), ("z3-nvme", ["parallel.zero=3"] + nvme)):
        runs[name] = worlds(2).run(init_then_train_task, common + extra, str(tmp_path / name))
    for base, offloaded in (("z1", "z1-host"), ("z3", "z3-nvme")):
        for a, b in zip(runs[offloaded], runs[base]):
            assert rel_err(torch.tensor(a["losses"]), torch.tensor(b["losses"])) <= 1e-5, (offloaded, a["losses"],
                                                                                           b["losses"])
            assert max_rel_err(a["params"], b["params"])[0] <= 1e-5, offloaded


def test_compressor_state_resumes_bitwise_under_the_same_layout(worlds, tmp_path):
    """DGC's residuals and momenta live in the checkpoint (rank/<r>/...): a resumed run is the same run."""
    dgc = ["model.preset=tiny", "train.steps=6", "train.global_batch=8", "train.seq_len=32", "train.optimizer=sgd",
           "train.lr=0.3", "train.weight_decay=0", "compress.method=dgc", "compress.dgc_sparsity=0.99",
           "checkpoint.save_every=3"]
    whole = worlds(2).run(train_task, dgc, str(tmp_path / "whole"))
    ckpt = tmp_path / "whole" / "checkpoints" / "step-00000003"
    resumed = worlds(2).run(train_task, dgc + [f"checkpoint.resume={ckpt}"], str(tmp_path / "resumed"))
    assert resumed[0]["losses"] == whole[0]["losses"][3:]
    for a, b in zip(resumed, whole):
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])
    # without the residuals the continuation differs: the state matters
    manifest = (ckpt / "manifest.json").read_text()
    assert '"rank/00000/bucket.' in manifest and '"rank/00001/bucket.' in manifest


def test_async_save_under_nvme_zero3_resumes_bitwise(worlds, tmp_path):
    """NVMe offload + ZeRO-3 + async saves: the snapshot reads the shards that settle() brought in from their
    scratch file, on the writer's thread, while the next step's pass would write them back and release them
    (storage of size 0: the save failed). Both saves complete, verify, and the run resumed from step 3 is the
    uninterrupted run: the same losses and parameters, bit for bit."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    common = BASE[:1] + ["train.steps=6", "train.global_batch=8", "train.seq_len=32", "train.lr=1e-3",
                         "train.eps=1e-6", "parallel.zero=3", "parallel.offload=nvme",
                         f"parallel.offload_dir={scratch}", "parallel.offload_block_mb=0.05",
                         "checkpoint.async_save=true", "checkpoint.save_every=3"]
    whole = worlds(2).run(init_then_train_task, common, str(tmp_path / "whole"))
    ckpts = tmp_path / "whole" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [step_dir_name(3), step_dir_name(6)]
    assert verify(ckpts / step_dir_name(3))[1] == [] and verify(ckpts / step_dir_name(6))[1] == []
    resumed = worlds(2).run(init_then_train_task, common + [f"checkpoint.resume={ckpts / step_dir_name(3)}"],
                            str(tmp_path / "resumed"))
    for a, b in zip(resumed, whole):
        assert len(b["losses"]) == 6 and a["losses"] == b["losses"][3:]
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])


def failing_writer_task(out: str) -> dict:
    """Train 6 steps saving asynchronously every 3 with a writer that raises; where the error surfaced."""
    import threefold.checkpoint.checkpointer as checkpointer_module
    from threefold.train.trainer import Trainer

    def broken(*args, **kwargs):
        raise RuntimeError("injected: the rank's file could not be written")

    real = checkpointer_module.write_rank
    checkpointer_module.write_rank = broken
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            trainer = Trainer(make_config(BASE + ["train.steps=6", "checkpoint.save_every=3",
                                                  "checkpoint.async_save=true"], out))
            try:
                trainer.run()
            except Exception as e:  # noqa: BLE001 - what reached the training thread, and when
                return {"steps_done": trainer.step, "type": type(e).__name__, "error": str(e)}
    finally:
        checkpointer_module.write_rank = real
    return {"steps_done": trainer.step, "type": None, "error": None}


def test_an_async_save_failure_surfaces_at_the_next_step(worlds, tmp_path):
    """The step-3 save's writer fails on its thread: the training thread raises it as one line in the update of
    step 4 (step 5 at worst: the writer had not finished raising when step 4's update began), not at the step-6
    save three steps later, and no checkpoint appears."""
    result = worlds(1).run(failing_writer_task, str(tmp_path))[0]
    assert result["type"] == "CheckpointError", result
    assert result["steps_done"] in (3, 4), result
    line = result["error"]
    assert "\n" not in line and "asynchronous save of step 3 failed (RuntimeError: injected" in line, line
    assert not any(p.name.startswith("step-") for p in (tmp_path / "checkpoints").iterdir())
