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


def _streamed(tmp_path, numel=3000, block_units=1024):
    """An AdamW NvmeOptimizer over one parameter of `numel` elements in units of `block_units` elements."""
    cfg = TrainConfig(lr=1e-2, optimizer="adamw")
    param, grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)), torch.ones(numel)
    settings = ScratchSettings(tmp_path, 1, 3 * 4 * block_units / 2**20)
    nvme = NvmeOptimizer(flat_pieces(param, grad, [numel // 2]), cfg, settings)
    return nvme, param


def _step(opt):
    opt.prepare_grads(1.0)
    opt.step()


def _overwrite(path: Path, offset: int, nbytes: int) -> None:
    """What another writer (a bad disk, a stray process) does to the file: other bytes in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes((7 * i + 1) % 256 for i in range(nbytes)))


def test_a_corrupted_scratch_block_stops_the_step_with_one_line_naming_file_and_unit(tmp_path):
    """The issue's attack: the first 64 KiB of the scratch file overwritten between steps. The next step's read
    of unit 0 fails its checksum: a ConfigError naming the file, the unit and the corruption, before anything of
    the corrupted unit reaches the model (the parameter keeps its last step's values)."""
    nvme, param = _streamed(tmp_path, numel=3 * 16384, block_units=16384)  # units of 3 x 64 KiB
    _step(nvme)
    before = param.clone()
    _overwrite(nvme.path, 0, 65536)
    with pytest.raises(ConfigError) as err:
        _step(nvme)
    line = str(err.value)
    assert "\n" not in line and line.startswith("parallel.offload_dir: ") and str(nvme.path) in line
    assert "unit 0 (bytes 0-196607)" in line and "the scratch storage corrupted data" in line
    assert torch.equal(param, before)
    nvme.close()


@pytest.mark.parametrize("reader", ["step", "named_state", "after_load"])
def test_every_read_of_a_scratch_block_is_checked(tmp_path, reader):
    """Each way the optimizer reads the file (a step's stream, a checkpoint's named_state, checkpoint.init_from's
    masters into kept moments) verifies every unit it reads: the count of checks is the count of units read
    (from the bytes read), and one changed byte in the middle unit is refused on that path."""
    nvme, _ = _streamed(tmp_path)
    unit_bytes = [u.padded * 4 * 3 for u in nvme.units]
    assert len(unit_bytes) == 3
    _step(nvme)
    assert nvme.sums.checked == 3 and nvme.stats.read_bytes == sum(unit_bytes)
    run = {"step": lambda: _step(nvme), "named_state": nvme.named_state,
           "after_load": lambda: nvme.after_load(1, masters_loaded=False)}[reader]
    run()
    assert nvme.sums.checked == 6 and nvme.stats.read_bytes == 2 * sum(unit_bytes)
    middle = nvme.units[1]
    with open(nvme.path, "r+b") as f:  # one byte of unit 1's second moment flipped
        f.seek(middle.offset + unit_bytes[1] - 5)
        byte = f.read(1)
        f.seek(middle.offset + unit_bytes[1] - 5)
        f.write(bytes([byte[0] ^ 0x10]))
    nvme._loaded = None  # named_state reads the file again
    with pytest.raises(ConfigError, match=rf"{nvme.path.name}: unit 1 \(bytes {middle.offset}-"):
        run()
    nvme.close()


def test_zero3_shard_store_checks_every_shard_read(tmp_path):
    """ZeRO-3's parameter shards in their (unlinked) scratch file: every read is checked against the sum taken at
    its write; bytes changed under a released shard stop its next load with the same one line."""
    from threefold.parallel.shard_store import ShardStore

    store = ShardStore(ScratchSettings(tmp_path))
    values = [torch.arange(n, dtype=torch.float32) + 0.5 for n in (1000, 3000, 10)]
    shards = [v.clone() for v in values]
    for index, shard in enumerate(shards):
        store.add(index, shard, [f"p{index}"])
    assert [s.untyped_storage().nbytes() for s in shards] == [0, 0, 0]  # released after the write
    store.settle()
    assert all(torch.equal(s, v) for s, v in zip(shards, values)) and store.sums.checked == 3
    store.begin_pass()
    import os

    os.pwrite(store.fd, b"\xff" * 8, store.offsets[1] + 100)
    store.load(0)  # reads unit 0 and starts the read of unit 1 ahead
    assert torch.equal(shards[0], values[0])
    with pytest.raises(ConfigError, match=r"-params.scratch: params unit 1 \(bytes 4096-16095\) read back other"):
        store.load(1)
    assert store.sums.checked == 5
    store.close()


def test_an_optimizer_without_a_streamed_update_is_refused_in_one_line(tmp_path):
    """NVMe offload streams the update the optimizer registry names (`OptimizerEntry.streamed`); one that
    names none (Muon, whose update needs whole matrices) is refused naming the key, not run as AdamW."""
    from threefold.optim.registry import ENTRIES

    assert {name for name, e in ENTRIES.items() if e.streamed is not None} == {"adamw", "sgd"}
    w, g = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ConfigError) as err:
        NvmeOptimizer(flat_pieces(w, g, [4]), TrainConfig(optimizer="muon"), ScratchSettings(tmp_path))
    assert str(err.value).startswith("parallel.offload:") and "muon" in str(err.value) and "\n" not in str(err.value)
