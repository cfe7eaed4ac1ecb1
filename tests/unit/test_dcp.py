"""torch.distributed.checkpoint directories in one process: names, boxes, bad input (checkpoint/dcp.py).

The DCP directories are written here by plain torch (`get_state_dict` + `dcp.save`), never by threefold.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from tests.checkpoint_layouts import save_synthetic, tp_split, zero_shard
from threefold.checkpoint.dcp import DcpIndex, dcp_key, is_dcp, load_dcp_entries, threefold_name
from threefold.checkpoint.format import CheckpointError
from threefold.checkpoint.state import Entry
from threefold.cli import main
from threefold.sharding import Placement


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)


@pytest.fixture(scope="module")
def plain_dcp(tmp_path_factory):
    """A plain module and AdamW after two steps, saved in torchtitan's form; returns (dir, module, optimizer)."""
    torch.manual_seed(0)
    model = Plain()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model.norm(model.up(torch.randn(4, 6))).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    path = tmp_path_factory.mktemp("plain") / "dcp"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path), no_dist=True)
    return path, model, optimizer


def test_names_map_one_to_one():
    for name, key in (("model/blocks.0.attn.q.weight", "model.blocks.0.attn.q.weight"),
                      ("optim/blocks.0.attn.q.weight/exp_avg", "optimizer.state.blocks.0.attn.q.weight.exp_avg"),
                      ("optim/embed.tok.weight/step", "optimizer.state.embed.tok.weight.step")):
        assert dcp_key(name) == key and threefold_name(key, bare_model=False) == name
    # torchtitan writes the model's keys bare, beside its other states
    assert threefold_name("layers.0.w1.weight", bare_model=True) == "model/layers.0.w1.weight"
    for key in ("optimizer.param_groups.x.weight.lr", "lr_scheduler.last_epoch", "train_state.step"):
        assert threefold_name(key, bare_model=True) is None


def test_a_rank_reads_its_boxes_of_a_plain_checkpoint(plain_dcp):
    path, model, optimizer = plain_dcp
    assert is_dcp(path) and not is_dcp(path.parent)
    index = DcpIndex(path)
    weight = model.up.weight.detach()
    moment = optimizer.state[model.up.weight]["exp_avg"]
    # a tensor-parallel row shard, and a ZeRO flat shard that starts and ends inside rows
    rows = tp_split("model/up.weight", (10, 6), 0, 2)[1]
    flat = zero_shard(Placement.whole("optim/up.weight/exp_avg", (10, 6)), 3)[1]
    entries = [Entry("model/up.weight", torch.full(rows.shape, float("nan")), rows),
               Entry("optim/up.weight/exp_avg", torch.full((20,), float("nan")), flat)]
    load_dcp_entries(index, entries)
    assert torch.equal(entries[0].tensor, weight[5:])
    assert torch.equal(entries[1].tensor, moment.reshape(-1)[20:40])
    assert {n for n in index.keys if n.startswith("optim/norm.bias/")} == {
        "optim/norm.bias/exp_avg", "optim/norm.bias/exp_avg_sq", "optim/norm.bias/step"}


@pytest.mark.parametrize("name, shape, says", [
    ("model/up.bias.missing", (10,), "no tensor 'model.up.bias.missing'"),
    ("optim/up.weight/exp_avg", (10, 7), "tensor 'optimizer.state.up.weight.exp_avg' has shape [10, 6], "
                                         "the model expects [10, 7]")])
def test_a_missing_key_or_another_shape_is_one_line_naming_key_and_file(plain_dcp, name, shape, says):
    path = plain_dcp[0]
    with pytest.raises(CheckpointError) as raised:
        load_dcp_entries(DcpIndex(path), [Entry(name, torch.zeros(shape), Placement.whole(name, shape))])
    message = str(raised.value)
    assert says in message and str(path / ".metadata") in message and "\n" not in message, message


def test_export_refuses_an_occupied_directory_in_one_line(tmp_path, capsys):
    place = Placement.whole("w", (4, 4))
    ckpt = save_synthetic(tmp_path / "checkpoints", 1, [({}, {"model/w": place})], {"w": torch.ones(4, 4)})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main(["ckpt", "export", str(ckpt), "--dcp", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "exists and is not an empty directory" in err and len(err.splitlines()) == 1, err
    assert main(["ckpt", "export", str(ckpt), "--dcp", str(tmp_path / "new")]) == 0
    assert is_dcp(tmp_path / "new")


def test_a_resume_fills_weights_and_moments_and_takes_the_step(plain_dcp):
    from threefold.checkpoint.dcp import load_dcp
    from threefold.checkpoint.state import TrainingState

    path, model, optimizer = plain_dcp
    mine = Plain()
    places = {n: Placement.whole(n, p.shape) for n, p in mine.named_parameters()}
    adamw = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    state = TrainingState(list(mine.named_parameters()), places, adamw)
    manifest = load_dcp(path, state)
    assert manifest.step == 2 and manifest.layout == {"format": "dcp"}
    for (name, p), q in zip(mine.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(adamw.state[p][key], optimizer.state[q][key]), f"{name} {key}"


def test_a_run_that_meets_no_dcp_directory_does_not_import_it():
    """torch.distributed.checkpoint takes seconds to import; the checkpointer imports it only for a DCP directory."""
    import subprocess
    import sys

    code = "import sys, threefold.checkpoint.checkpointer; print('torch.distributed.checkpoint' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
