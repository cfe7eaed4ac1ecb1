"""One layout record (layout.py `Layout`): the config's checks, the Mesh, fault injection, checkpoint
metadata and the planner read the same record, and its written forms read back as the old ones did."""

import json

import pytest

from threefold.config import load_config
from threefold.errors import ConfigError
from threefold.layout import Layout


def test_the_mesh_the_config_and_the_planner_share_one_record():
    from threefold.mesh import Layout as MeshLayout
    from threefold.planner.workload import Strategy, from_config

    assert MeshLayout is Layout and issubclass(Strategy, Layout)
    cfg = load_config(None, ["model.preset=tiny", "parallel.tp=2", "parallel.cp=2", "train.seq_len=64",
                             "train.global_batch=8"])
    assert Layout.of(cfg.parallel, 8) == Layout(dp=2, tp=2, cp=2)  # dp "auto": what cp x tp x pp leave of 8
    _, st = from_config(cfg, 8, "cpu")
    assert Layout.of(st) == Layout(dp=2, tp=2, cp=2) and (st.world_size, st.replicas) == (8, 4)
    with pytest.raises(ConfigError, match=r"layout dp=auto x cp=2 x tp=2 x pp=1 does not match the world size 6"):
        cfg.validate(6)


def test_a_fault_layout_names_the_mesh_sizes_and_not_ep():
    """A fault written for dp 2 fires in a dp 2 run, with or without experts cut out of dp (ep is not an
    axis of the world), and not in dp 2 x cp 2 (the layout handed to fault injection keeps cp)."""
    from torch import nn

    from threefold.config.debug_checks import fault_applies
    from threefold.observe.faults import FaultInjector

    fault = load_config(None, ["fault.rank=0", "fault.kind=raise", "fault.layout=2,1,1"]).fault
    assert fault_applies(fault, Layout(dp=2)) and fault_applies(fault, Layout(dp=2, ep=2))
    assert not fault_applies(fault, Layout(dp=2, cp=2)) and not fault_applies(fault, Layout(dp=1, cp=2))
    assert FaultInjector(fault, Layout(dp=2, ep=2), 0, nn.Linear(2, 2), 8).active
    assert not FaultInjector(fault, Layout(dp=2, cp=2), 0, nn.Linear(2, 2), 8).active
    fault = load_config(None, ["fault.rank=0", "fault.kind=raise", "fault.layout=2,1,1,2"]).fault
    assert fault_applies(fault, Layout(dp=2, cp=2)) and not fault_applies(fault, Layout(dp=2))


def test_the_written_forms_read_back():
    layout = Layout(dp=4, tp=2, pp=2, ep=2, cp=2)
    assert str(layout) == "dp=4 tp=2 pp=2 ep=2 cp=2" and str(Layout(dp=2)) == "dp=2 tp=1 pp=1"
    assert layout.text == "4,2,2,2" and Layout.parse(layout.text, "k") == Layout(dp=4, tp=2, pp=2, cp=2)
    assert Layout.parse("2,1,1", "k").text == "2,1,1"
    assert Layout.from_fields(layout.fields()) == layout and Layout.from_fields(Layout().fields()) == Layout()
    for text in ("2,1", "2,x,1", "0,1,1", "1,1,1,0", "1,1,1,1,1"):
        with pytest.raises(ConfigError, match=r"fault.layout: '.*' is not a layout; write dp,tp,pp or dp,tp,pp,cp"):
            Layout.parse(text, "fault.layout")
    with pytest.raises(ConfigError, match=r"--layouts: '1,1,1,2' is not a layout; write dp,tp,pp with"):
        Layout.parse("1,1,1,2", "--layouts", cp=False)


def _old_record(dp, tp, pp, zero, world_size, ep=1, cp=1):
    """The manifest's layout as the trainer wrote it by hand before the record (train/trainer.py)."""
    layout = {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "world_size": world_size}
    if ep > 1:
        layout["ep"] = ep
    if cp > 1:
        layout["cp"] = cp
    return layout


@pytest.mark.parametrize("sizes", [dict(dp=2, tp=1, pp=1), dict(dp=4, tp=2, pp=1, ep=2),
                                   dict(dp=2, tp=1, pp=2, cp=2), dict(dp=4, tp=1, pp=1, ep=2, cp=2)])
def test_checkpoint_layout_fields_read_both_ways(sizes):
    """The manifest's layout is the JSON it always was (same keys, same order), and a manifest written
    before the record reads back as the same Layout."""
    from threefold.checkpoint.format import Manifest, layout_record, parse_manifest

    layout = Layout(**sizes)
    old = _old_record(**sizes, zero=1, world_size=layout.world_size)
    assert json.dumps(layout_record(layout, 1)) == json.dumps(old)
    raw = json.loads(Manifest(step=3, layout=old, tensors={}, files={}).to_json())
    manifest = parse_manifest(raw, "test")
    assert manifest.layout == old and manifest.written_layout == layout
    assert Manifest(step=0, layout={"format": "dcp"}, tensors={}, files={}).written_layout is None
