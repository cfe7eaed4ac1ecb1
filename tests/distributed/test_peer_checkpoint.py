"""checkpoint.peer_copy on two ranks, each with its own keeper (as two nodes would have): a resume
reads the files from the keepers' memory and continues bitwise like a resume from storage; a
corrupted or missing in-memory copy falls back to storage with one warning line for the world.
The lost-node case, with real launchers, is in tests/e2e/test_multinode.py."""

import contextlib
import io

import pytest
import torch

from tests.helpers import make_config

BASE = ["model.preset=tiny", "train.global_batch=4", "train.seq_len=16", "train.eps=1e-6", "parallel.tp=2",
        "checkpoint.save_every=2"]
STEP_FILE = "step-00000004"


def _resume(out: str, ckpt: str, peer: bool) -> dict:
    from threefold.train.trainer import Trainer

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        trainer = Trainer(make_config(BASE + ["train.steps=6", f"checkpoint.resume={ckpt}",
                                              f"checkpoint.peer_copy={str(peer).lower()}"], out))
        losses = [r["loss"] for r in trainer.run()]
    params = {n: p.detach().clone() for n, p in trainer.parallel.module.named_parameters()}
    return {"losses": losses, "params": params, "stderr": err.getvalue()}


def _save_then_resume_four_ways(out: str) -> dict:
    """Train 4 steps with peer copies, then resume from step 4: from storage (peer_copy off), from
    memory, with this rank's own file altered in its keeper, with rank 1's file gone from both."""
    import os

    from threefold.checkpoint.peer import Keeper
    from threefold.train.trainer import Trainer

    keeper = Keeper()
    os.environ.update(keeper.environment())
    try:
        trainer = Trainer(make_config(BASE + ["train.steps=4", "checkpoint.peer_copy=true"], f"{out}/run"))
        trainer.run()
        rank = trainer.mesh.global_rank
        ckpt = f"{out}/run/checkpoints/{STEP_FILE}"
        held = {name: len(data) for name, (_, data) in keeper.files[4].items()}
        result = {"held": held, "storage": _resume(f"{out}/storage", ckpt, False),
                  "memory": _resume(f"{out}/memory", ckpt, True)}
        own = f"rank-{rank:05d}.safetensors"
        sha, data = keeper.files[4][own]
        keeper.files[4][own] = (sha, data[:-1] + bytes([data[-1] ^ 1]))  # one bit of the last value
        result["corrupt"] = _resume(f"{out}/corrupt", ckpt, True)
        keeper.files[4][own] = (sha, data)
        del keeper.files[4]["rank-00001.safetensors"]  # this node's and (ring) the peer's copy
        result["missing"] = _resume(f"{out}/missing", ckpt, True)
        return result
    finally:
        keeper.close()
        for name in keeper.environment():
            del os.environ[name]


@pytest.fixture(scope="module")
def resumed(worlds, tmp_path_factory):
    return worlds(2).run(_save_then_resume_four_ways, str(tmp_path_factory.mktemp("peer")))


def _same_run(got: dict, want: dict) -> None:
    assert got["losses"] == want["losses"] and len(got["losses"]) == 2
    for name, p in want["params"].items():
        assert torch.equal(got["params"][name], p), name


def test_resume_reads_peer_memory_and_matches_storage_bitwise(resumed):
    files = {"rank-00000.safetensors", "rank-00001.safetensors"}
    for rank, r in enumerate(resumed):
        assert set(r["held"]) == files, "each keeper holds its node's file and (ring) the peer's"
        _same_run(r["memory"], r["storage"])
        assert "warning" not in r["memory"]["stderr"], r["memory"]["stderr"]
    line = [s for s in resumed[0]["memory"]["stderr"].splitlines() if s.startswith("threefold: loaded")]
    assert line and line[0].endswith("file reads from peer memory, 0 from storage"), resumed[0]["memory"]["stderr"]
    assert not line[0].startswith(f"threefold: loaded {STEP_FILE}: 0 "), line


@pytest.mark.parametrize("case,why", [("corrupt", "sha256 mismatch"), ("missing", "no keeper of this world holds it")])
def test_unusable_copy_falls_back_to_storage_with_one_warning(resumed, case, why):
    per_rank = [[s for s in r[case]["stderr"].splitlines() if "warning" in s] for r in resumed]
    warnings = per_rank[0]  # rank 0's: the line the terminal shows
    assert len(warnings) == 1 and per_rank[1] == [] and why in warnings[0], per_rank
    assert warnings[0].startswith("threefold: warning: checkpoint.peer_copy: the in-memory copy of rank-0000"), warnings
    assert warnings[0].endswith("read from storage instead"), warnings
    for r in resumed:
        _same_run(r[case], r["storage"])
    loaded = [s for s in resumed[0][case]["stderr"].splitlines() if s.startswith("threefold: loaded")]
    assert loaded and not loaded[0].endswith(" 0 from storage"), loaded
