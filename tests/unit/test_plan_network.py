"""Networks and the H800 preset of the planner (docs/planner.md, "Networks and presets"): named
inter-node networks chosen with `threefold plan --network NAME` (or `network = "NAME"` in a GPU's
TOML table), `--inter-gbps` overriding their rate, bad names one line and exit 2."""

import json

import pytest

from threefold.cli import main
from threefold.planner.hardware import GB, NETWORKS, PRESETS, load_gpu, with_network
from threefold.planner.search import evaluate
from threefold.planner.workload import Strategy, Workload
from threefold.config import load_config


def plan_json(capsys, *options):
    assert main(["plan", "--model", "tiny", "--gpus", "16", "--json", *options]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_network_has_its_rate_and_source():
    expected = {"ib-hdr": 200, "ib-ndr": 400, "roce-200": 200, "roce-400": 400, "efa-p4d": 50, "efa-p5": 400}
    for name, gbps in expected.items():
        assert NETWORKS[name].gbps == gbps, name
    assert all(n.source and n.kind in ("InfiniBand", "RoCE", "EFA") for n in NETWORKS.values())


def test_h800_preset_is_an_h100_with_the_slower_nvlink():
    h800, h100 = PRESETS["h800-80gb"], PRESETS["h100-80gb"]
    assert h800.peak_flops == h100.peak_flops == 989e12 and h800.memory_bytes == h100.memory_bytes
    assert h800.intra_bytes_per_s == 200 * GB  # 400 GB/s total, both directions
    assert h800.inter_bytes_per_s == 50 * GB  # one 400 Gb/s InfiniBand NIC per GPU (DeepSeek-V3's cluster)


def test_network_option_sets_the_rate_and_inter_gbps_overrides_it(capsys):
    out = plan_json(capsys, "--network", "efa-p4d")
    assert out["gpu"]["network"]["name"] == "efa-p4d" and out["gpu"]["network"]["gbps_per_gpu"] == 50
    assert out["gpu"]["infiniband"] == "efa-p4d"
    out = plan_json(capsys, "--network", "efa-p4d", "--inter-gbps", "100")
    assert out["gpu"]["network"]["gbps_per_gpu"] == 100 and out["gpu"]["network"]["name"] is None
    out = plan_json(capsys)  # the preset's own network, named
    assert out["gpu"]["network"]["name"] == "ib-ndr" and out["gpu"]["infiniband"] == "ndr"


def test_bad_network_name_is_one_line_listing_the_choices(capsys):
    assert main(["plan", "--model", "tiny", "--network", "myrinet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--network" in err and "myrinet" in err
    assert all(name in err for name in NETWORKS)


def test_gpu_toml_names_its_network(tmp_path):
    toml = tmp_path / "g.toml"
    toml.write_text('[gpu]\npeak_tflops = 989\nmemory_gib = 80\nhbm_tbps = 3.35\nnvlink_gbps = 450\n'
                    'network = "roce-200"\n')
    gpu = load_gpu(str(toml))
    assert gpu.inter_bytes_per_s == 25 * GB and gpu.infiniband == "roce-200"
    toml.write_text('[gpu]\npeak_tflops = 989\nmemory_gib = 80\nhbm_tbps = 3.35\nnvlink_gbps = 450\n'
                    'network = "token-ring"\n')
    with pytest.raises(Exception, match="token-ring.*choose one of ib-edr"):
        load_gpu(str(toml))


def test_a_slower_network_slows_a_plan_whose_dp_crosses_nodes():
    m = load_config(None, ["model.preset=llama-7b"]).model
    w, st = Workload(m, 256, 4096), Strategy(dp=16, tp=1, pp=1, zero=3, microbatches=16, remat="full")
    h100 = PRESETS["h100-80gb"]
    fast, slow = (evaluate(w, st, with_network(h100, NETWORKS[n])).time for n in ("efa-p5", "efa-p4d"))
    # 50 against 400 Gb/s per GPU: the bandwidth term 8x; the latencies not (a ring's steps inside a node
    # run over NVLink on both, planner/comm.py `Group`), so a little under 8x
    assert 7 * fast.dp_comm_s < slow.dp_comm_s <= 8 * fast.dp_comm_s, (slow.dp_comm_s, fast.dp_comm_s)
    assert slow.total_s > fast.total_s
