"""Node options, Slurm's variables and the multi-node launcher's bad input (no processes start)."""

import hashlib
import time

import pytest

from tests.e2e.cli import threefold
from threefold.errors import UserError
from threefold.launch.local import free_port
from threefold.launch.nodes import (adopt_slurm_tasks, first_slurm_host, nodes_from_options, parse_nnodes,
                             slurm_node_options, tasks_per_node, tp_across_nodes)


def test_nnodes_forms():
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "a", "1:2:3", "2:x"):
        with pytest.raises(UserError, match="--nnodes"):
            parse_nnodes(bad)
    with pytest.raises(UserError, match="MIN 3 is larger than MAX 2"):
        parse_nnodes("3:2")


def test_node_options_need_an_endpoint_and_a_rank_in_range():
    assert nodes_from_options(None, None, None, env={}) is None
    with pytest.raises(UserError, match="--rdzv-endpoint"):
        nodes_from_options("2", 0, None, env={})
    with pytest.raises(UserError, match="--node-rank"):
        nodes_from_options("2", 2, "h:1234", env={})
    nodes = nodes_from_options("1:2", 1, "node7:29400", env={})
    assert (nodes.min, nodes.max, nodes.node_rank, nodes.host, nodes.port) == (1, 2, 1, "node7", 29400)
    assert not nodes.hosts_rendezvous and not nodes.on_loopback


def test_slurm_variables():
    assert first_slurm_host("node[003-005,9],gpu1") == "node003" and first_slurm_host("gpu1,gpu2") == "gpu1"
    assert tasks_per_node({"SLURM_TASKS_PER_NODE": "4(x2)"}) == 4
    per_node = {"SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[01-02]"}
    assert slurm_node_options(per_node) == ("2", 1, "n01:29500")
    assert slurm_node_options({**per_node, "SLURM_NTASKS": "8"}) is None  # one task per process: no launcher
    env = {"SLURM_NNODES": "2", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[01-02]"}
    adopt_slurm_tasks(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"]) == \
        ("3", "4", "1", "2", "n01")


def test_tp_across_nodes_warns():
    assert tp_across_nodes(2, 4) is None and tp_across_nodes(1, 3) is None
    assert "span nodes" in tp_across_nodes(4, 2) and "span nodes" in tp_across_nodes(2, 3)


RUN = ["train", "--model", "tiny", "--steps", "1", "--no-progress"]


def test_min_above_max_is_one_line(tmp_path):
    done = threefold(*RUN, "--nnodes", "3:2", "--rdzv-endpoint", "127.0.0.1:1", "--out", str(tmp_path / "r"))
    assert done.returncode == 2
    assert done.stderr.strip() == "threefold: error: --nnodes: MIN 3 is larger than MAX 2; give MIN:MAX with MIN <= MAX"


def test_unreachable_endpoint_is_one_line_after_a_bounded_wait(tmp_path):
    port = free_port()  # nobody listens there
    start = time.monotonic()
    done = threefold(*RUN, "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "--rdzv-timeout", "2", "--nproc", "1", "--out", str(tmp_path / "r"), timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"threefold: error: --rdzv-endpoint: nothing answers at "
                                                   f"127.0.0.1:{port} after 2 s"), done.stderr
    assert time.monotonic() - start >= 2
    assert not (tmp_path / "r").exists()


def test_missing_node_is_one_line_after_the_join_timeout(tmp_path):
    port = free_port()
    done = threefold(*RUN, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}",
                     "--rdzv-timeout", "3", "--nproc", "1", "--out", str(tmp_path / "r"), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"threefold: error: --nnodes: the rendezvous at 127.0.0.1:{port} did not complete within 3 s"), done.stderr


def elastic_config(**keys):
    from threefold.config import load_config

    return load_config(None, ["model.preset=tiny", *[f"{k.replace('__', '.')}={v}" for k, v in keys.items()]])


def test_elastic_layout_keeps_tp_pp_and_the_global_batch():
    cfg = elastic_config(parallel__elastic_world=8, parallel__tp=2, train__global_batch=8)
    full, half = cfg.validate(8), cfg.validate(4)
    assert (full.parallel.dp, full.train.microbatches) == (4, 1)
    assert (half.parallel.dp, half.parallel.tp, half.train.microbatches) == (2, 2, 2)  # micro-batches of 2 sequences
    assert half.train.global_batch == 8 and half.validate(4) == half  # re-derived once


def test_elastic_layout_keeps_cp_with_tp_and_pp():
    from threefold.errors import ConfigError

    cfg = elastic_config(parallel__elastic_world=16, parallel__cp=2, parallel__tp=2, parallel__pp=2,
                         model__layers=2, train__global_batch=8, train__seq_len=16)
    full, half = cfg.validate(16), cfg.validate(8)
    assert (full.parallel.dp, full.parallel.cp, full.parallel.tp, full.parallel.pp) == (2, 2, 2, 2)
    assert (half.parallel.dp, half.parallel.cp, half.parallel.tp, half.parallel.pp) == (1, 2, 2, 2)
    assert half.train.microbatches == 2 * full.train.microbatches  # the micro-batch size stays
    with pytest.raises(ConfigError) as e:
        cfg.validate(12)  # one replica is cp x tp x pp = 8 ranks
    assert "(dp=2 cp=2 tp=2 pp=2 microbatches=" in str(e.value) and "cp=2 x tp=2 x pp=2 = 8 does not divide 12" \
        in str(e.value)


def test_elastic_layout_that_does_not_fit_names_the_smallest_world():
    from threefold.errors import ConfigError

    cfg = elastic_config(parallel__elastic_world=6, train__global_batch=12)
    assert cfg.validate(3).train.microbatches == 2
    with pytest.raises(ConfigError) as e:
        cfg.validate(4)  # 12 sequences are not 4 ranks x micro-batches of 2
    assert str(e.value) == (
        "parallel.elastic_world: the layout written for 6 processes (dp=6 tp=1 pp=1 microbatches=1) cannot be "
        "re-derived for the 4 processes left (train.global_batch: 12 sequences are not a whole number of "
        "micro-batches of 2 for dp=4); the smallest world that works is 1 process")


def test_elastic_launch_without_a_layout_for_min_nodes_is_one_line(tmp_path):
    done = threefold(*RUN, "--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--nproc", "2", "--tp", "4",
                     "--resume", "auto", "--save-every", "1", "--max-restarts", "1", "--out", str(tmp_path / "r"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "threefold: error: --nnodes 1:2: the layout (dp=1 tp=4 pp=1) cannot be re-derived for 1 node of 2 "
        "processes (parallel: tp=4 x pp=1 = 4 does not divide 2); the smallest node count that works is 2: "
        "use --nnodes 2:2")
    done = threefold(*RUN, "--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:1", "--nproc", "2",
                     "--out", str(tmp_path / "r"))
    assert done.returncode == 2 and "pass --resume auto and --save-every N" in done.stderr, done.stderr


# ---------------------------------------------------------------- in-memory checkpoint copies

def test_keeper_serves_what_it_was_sent_and_keeps_the_two_newest_steps():
    from threefold.checkpoint import peer

    keeper = peer.Keeper()
    address, secret, name = keeper.address, keeper.secret, "rank-00001.safetensors"
    sha = {step: hashlib.sha256(bytes([step]) * 1000).hexdigest() for step in (3, 6, 9)}
    try:
        for step in (3, 6, 9):
            peer.put(address, secret, step, name, sha[step], bytes([step]) * 1000)
        assert peer.get(address, secret, 9, name, 1000) == bytes([9]) * 1000
        assert peer.listing(address, secret, 6) == {name: {"sha256": sha[6], "bytes": 1000}}
        assert peer.listing(address, secret, 3) == {} and peer.get(address, secret, 3, name, 1000) is None
    finally:
        keeper.close()


def test_peer_copies_form_a_ring_over_the_nodes():
    from threefold.checkpoint.peer import PeerCopies

    keepers = ["a:1", "a:1", "b:1", "b:1", "c:1", "c:1"]  # 3 nodes of 2 ranks, ordered by lowest rank
    assert [(PeerCopies(r, keepers).mine, PeerCopies(r, keepers).replica) for r in (0, 2, 5)] == \
        [("a:1", "c:1"), ("b:1", "a:1"), ("c:1", "b:1")]  # node i keeps node i+1's files
    assert PeerCopies(1, ["a:1", "a:1"]).replica is None  # one node: no peer


def test_peer_copy_without_threefolds_launcher_is_one_line():
    from threefold.checkpoint.peer import PeerCopies
    from threefold.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.peer_copy: the in-memory copies are held by threefold's "
                                          "launcher; start the job with threefold train --nproc"):
        PeerCopies.local_address({})
