"""parallel.offload=nvme's optimizer (parallel/nvme.py) against the in-memory one, without a process group."""

from pathlib import Path

import pytest
import torch

from tests.helpers import flat_pieces

from threefold.config import TrainConfig
from threefold.errors import ConfigError
from threefold.parallel.master import ShardedOptimizer
from threefold.parallel.nvme import NvmeOptimizer, ScratchSettings, layout_units, scratch_bytes


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_streamed_units_update_exactly_like_the_host_pool(tmp_path, optimizer):
    """Pieces cut across units of 1024 elements (a block of 4 KiB per kind), prefetch 1 and 0:
    masters, moments and model the bits of ShardedOptimizer over the same pieces, and a
    checkpoint's named_state / load round trip through the file."""
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, optimizer=optimizer, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(50, 61, generator=gen)
    mine = ref.clone()
    g_ref, g_mine = torch.zeros_like(ref), torch.zeros_like(ref)
    cuts = [7, 1900, 2500]
    kinds = 2 if optimizer == "adamw" else 1
    block = (1 + kinds) * 4096 / 2**20
    host = ShardedOptimizer(flat_pieces(ref, g_ref, cuts), cfg, offload=True)
    nvme = NvmeOptimizer(flat_pieces(mine, g_mine, cuts), cfg, ScratchSettings(tmp_path, 1, block))
    assert len(nvme.units) == 3 and len(nvme.units[0].segments) == 2 and len(nvme.buffers) == 2
    assert nvme.path.stat().st_size == nvme.nbytes == scratch_bytes([7, 1893, 600, 550], kinds, block)
    for step in range(4):
        g = torch.randn(50, 61, generator=gen)
        g_ref.copy_(g)
        g_mine.copy_(g)
        for opt in (host, nvme):
            masters, _ = opt.prepare_grads(0.5)
            torch._foreach_mul_([m.grad for m in masters], 0.7)  # clipping scales the holders' gradients
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (step + 1)
            opt.step()
        assert torch.equal(mine, ref), f"step {step}"
    assert nvme.stats.read_bytes == 4 * nvme.nbytes == nvme.stats.write_bytes - nvme.nbytes
    ours, theirs = nvme.named_state(), host.named_state()
    assert [p for p, _ in ours] == [p for p, _ in theirs] and all(torch.equal(a, b) for (_, a), (_, b) in zip(ours, theirs))
    # a fresh optimizer (a new scratch file) loaded as a checkpoint loads: in place, then after_load
    again = NvmeOptimizer(flat_pieces(mine, g_mine, cuts), cfg, ScratchSettings(tmp_path, 0, block))
    for (_, dst), (_, src) in zip(again.named_state(), ours):
        dst.copy_(src)
    mine.zero_()
    again.after_load(4, masters_loaded=True)
    assert torch.equal(mine, ref) and again.state_tensors() == []
    g = torch.randn(50, 61, generator=gen)
    for opt, grad in ((host, g_ref), (again, g_mine)):
        grad.copy_(g)
        for group in opt.param_groups:
            group["lr"] = 1e-3
        opt.prepare_grads(1.0)
        opt.step()
    assert torch.equal(mine, ref)
    path = again.path
    again.close()
    assert not path.exists()


def test_units_are_aligned_blocks():
    units = layout_units([10, 5000, 3], 2, 3 * 4096 * 2)
    assert [u.numel for u in units] == [2048, 2048, 917]
    assert all(u.padded % 1024 == 0 and u.offset % 4096 == 0 for u in units)


def test_a_directory_without_room_or_write_access_is_refused(tmp_path):
    cfg = TrainConfig()
    pieces = flat_pieces(torch.zeros(100), torch.zeros(100), [50])
    with pytest.raises(ConfigError, match="parallel.offload_dir.*not a directory"):
        NvmeOptimizer(pieces, cfg, ScratchSettings(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="parallel.offload_dir.*is not writable"):
        NvmeOptimizer(pieces, cfg, ScratchSettings(Path("/proc/self")))  # refused even to root
    huge = flat_pieces(torch.empty(2**36, device="meta"), torch.empty(2**36, device="meta"), [])
    with pytest.raises(ConfigError, match=r"need 824633720832 bytes"):
        NvmeOptimizer(huge, cfg, ScratchSettings(tmp_path))


def test_a_stale_scratch_file_of_a_dead_process_is_removed(tmp_path):
    """A killed run leaves its scratch file: the next start on the same rank removes it (the states
    are rebuilt from the checkpoint or the initial values); a live process's file and other ranks' stay."""
    import subprocess
    import sys

    from threefold.parallel.nvme import scratch_name

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / scratch_name(0, dead.pid)
    other_rank = tmp_path / scratch_name(1, dead.pid)
    live = tmp_path / scratch_name(0, 1)  # pid 1 is alive
    for path in (stale, other_rank, live):
        path.write_bytes(b"x" * 4096)
    nvme = NvmeOptimizer(flat_pieces(torch.zeros(100), torch.zeros(100), [50]), TrainConfig(), ScratchSettings(tmp_path))
    assert not stale.exists() and other_rank.exists() and live.exists() and nvme.path.exists()
    path = nvme.path
    nvme.close()
    assert not path.exists()
