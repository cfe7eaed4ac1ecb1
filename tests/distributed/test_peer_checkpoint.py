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


# ---------------------------------------------------------------- keepers that let no one in

def _job_beside(out: str, case: str) -> dict:
    """Train 4 steps with peer copies (saves at 2 and 4) while this rank's keeper is attacked
    (`hostile`: requests without the secret, 5 x 100 MB claimed, 10^12 bytes claimed), refuses
    every file (`over_cap`: holds at most 1 byte), or never answers (`frozen`)."""
    import json
    import os
    import socket
    import time

    from threefold.checkpoint import peer
    from threefold.checkpoint.verify import verify
    from threefold.train.trainer import Trainer

    keeper = peer.Keeper(max_files=2, max_bytes=1 if case == "over_cap" else None) if case != "frozen" else None
    frozen = socket.create_server(("127.0.0.1", 0), backlog=64) if case == "frozen" else None
    env = keeper.environment() if keeper else {peer.KEEPER_ENV: f"127.0.0.1:{frozen.getsockname()[1]}",
                                               peer.SECRET_ENV: "a" * 32}
    os.environ.update(env)
    timeout, peer.IO_TIMEOUT_S = peer.IO_TIMEOUT_S, 1.0
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if case == "hostile":
                host, _, port = keeper.address.rpartition(":")
                for claim in [100 << 20] * 5 + [10**12]:
                    with socket.create_connection((host, int(port))) as s:
                        header = {"op": "put", "step": 10**9 + 1, "name": "rank-00000.safetensors",
                                  "sha256": "0" * 64, "bytes": claim}
                        with contextlib.suppress(OSError):
                            s.sendall(json.dumps(header).encode() + b"\n" + bytes(1 << 20))
                            s.recv(1)
                with socket.create_connection((host, int(port))) as s:
                    s.sendall(b'{"op": "get", "step": 2, "name": "rank-00001.safetensors"}\n')
                    answer = b"".join(iter(lambda: s.recv(1 << 16), b""))  # to the keeper's close
                    stolen = answer.split(b"\n", 1)[1]  # what follows its challenge (the nonce line)
            start = time.monotonic()
            trainer = Trainer(make_config(BASE + ["train.steps=4", "checkpoint.peer_copy=true"], f"{out}/{case}"))
            trainer.run()
            took = time.monotonic() - start
        checkpoints = {name: verify(trainer.checkpointer.root / name)[1] for name in ("step-00000002", STEP_FILE)}
        return {"stderr": err.getvalue(), "took": took, "checkpoints": checkpoints,
                "held": keeper.held_bytes() if keeper else 0, "steps": sorted(keeper.files) if keeper else [],
                "dropped": keeper.dropped if keeper else 0, "stolen": stolen if case == "hostile" else b""}
    finally:
        peer.IO_TIMEOUT_S = timeout
        for name in env:
            del os.environ[name]
        if keeper:
            keeper.close()
        if frozen:
            frozen.close()


@pytest.mark.parametrize("case,why", [
    ("hostile", "dropped a request from 127.0.0.1:"),
    ("over_cap", "do not fit: this keeper holds at most 1 bytes"),
    ("frozen", "this rank sends it no more copies")])
def test_a_keeper_under_attack_full_or_frozen_costs_one_warning_and_the_job_saves(worlds, tmp_path, case, why):
    results = worlds(2).run(_job_beside, str(tmp_path), case)
    for r in results:
        lines = [s for s in r["stderr"].splitlines() if "warning" in s]
        assert len(lines) == 1 and why in lines[0] and "Traceback" not in r["stderr"], r["stderr"]
        assert r["checkpoints"] == {"step-00000002": [], STEP_FILE: []}, "both saves complete and verify"
    if case == "hostile":
        for r in results:  # the attack got nothing and left nothing; the job's copies are all there
            assert r["dropped"] == 7 and r["stolen"] == b""
            assert r["steps"] == [2, 4] and 0 < r["held"] < 4 << 20, r
    if case == "over_cap":
        assert [r["held"] for r in results] == [0, 0]
    if case == "frozen":  # one timeout per keeper and rank (of 1 s), not the 600 s of the hang watchdog
        assert max(r["took"] for r in results) < 60, [r["took"] for r in results]
