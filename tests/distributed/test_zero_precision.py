"""Mixed precision with ZeRO: bf16 / fp16 loss curves against fp32, fp16 overflow handling."""

import torch

from tests.helpers import make_config
from tests.zero_tasks import train_stages

# Byte-level Python source, so the loss really falls (random tokens would stay at ln 256).
BASE = ["model.preset=tiny", "train.steps=20", "train.global_batch=8", "train.seq_len=32", "train.lr=3e-3",
        "data.source=stdlib"]
# Per-step relative loss difference allowed against fp32: one unit roundoff of the format
# (bf16: 8 significant bits, 2^-8; fp16: 11 bits, 2^-11). Each step's loss is a mean over 256
# tokens from a forward in the compute dtype, and the weights that produce it carry 20 steps of
# updates rounded to that dtype (the fp32 masters do not round): a correct implementation stays
# well inside one roundoff (measured: bf16 ~8e-4, fp16 ~4e-5), while losing the masters, the
# unscaling or a gradient shard moves the curve by far more.
TOLERANCE = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def test_bf16_and_fp16_follow_the_fp32_loss_curve(worlds, tmp_path):
    runs = [BASE + ["parallel.zero=0"],
            BASE + ["parallel.zero=2", "precision.compute=bf16"],
            BASE + ["parallel.zero=3", "precision.compute=fp16"]]
    for fp32, bf16, fp16 in worlds(2).run(train_stages, runs, str(tmp_path)):
        ref = fp32["losses"]
        assert ref[-1] < 0.85 * ref[0]  # it learns
        for run, dtype in ((bf16, "bf16"), (fp16, "fp16")):
            worst = max(abs(a - b) / b for a, b in zip(run["losses"], ref))
            assert 0 < worst <= TOLERANCE[dtype], (dtype, worst)  # > 0: it really computed in that dtype
            assert not any(run["skipped"])
        assert bf16["dtypes"] == {torch.bfloat16} and fp16["dtypes"] == {torch.float16}


def overflow_run(overrides: list[str], out: str, poison_step: int, steps: int) -> dict:
    """Train, with rank 1's loss made infinite at `poison_step`; record what every step did."""
    from threefold.train.trainer import Trainer

    trainer = Trainer(make_config(overrides, out))
    rank = trainer.mesh.rank("dp")

    def poison(module, args, output):
        return output * float("inf") if rank == 1 and trainer.step + 1 == poison_step else output

    trainer.parallel.module.loss.register_forward_hook(poison)
    records, snapshots, scales = [], [], []
    for _ in range(steps):
        records.append(trainer.train_one_step())
        trainer.parallel.settle()  # ZeRO-1's parameter gathers would otherwise overlap the next forward
        snapshots.append({n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()})
        scales.append(trainer.step_fn.scaler.scale)
    return {"skipped": [r["skipped"] for r in records], "used_scale": [r["loss_scale"] for r in records],
            "scale_after": scales, "snapshots": snapshots, "adam_steps": trainer.optimizer.step_count(),
            "state": trainer.step_fn.scaler.state_dict()}


def test_fp16_overflow_skips_that_step_on_every_rank(worlds, tmp_path):
    overrides = BASE + ["parallel.zero=1", "precision.compute=fp16", "precision.growth_interval=2",
                        "precision.initial_scale=1024"]
    results = worlds(2).run(overflow_run, overrides, str(tmp_path), 3, 6)
    for r in results:
        assert r["skipped"] == [False, False, True, False, False, False]
        # grows after 2 clean steps, halves on the overflow, grows again after 2 clean steps
        assert r["used_scale"] == [1024, 1024, 2048, 1024, 1024, 2048]
        assert r["scale_after"] == [1024, 2048, 1024, 1024, 2048, 2048]
        assert r["state"]["scale"] == 2048 and r["state"]["skipped_steps"] == 1
        # the skipped step changed nothing; the ones around it did
        before, skipped, after = r["snapshots"][1], r["snapshots"][2], r["snapshots"][3]
        assert all(torch.equal(before[n], skipped[n]) for n in before)
        assert not all(torch.equal(skipped[n], after[n]) for n in before)
        assert r["adam_steps"] == 5
    assert all(torch.equal(results[0]["snapshots"][-1][n], results[1]["snapshots"][-1][n])
               for n in results[0]["snapshots"][-1])  # replicas (stage 1 keeps whole parameters) agree
