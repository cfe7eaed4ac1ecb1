"""Planner compute, communication and step-time model, checked against published Megatron-LM runs."""

import math
from dataclasses import replace

import pytest

from threefold.config import load_config
from threefold.errors import UserError
from threefold.planner import comm
from threefold.planner.compute import block_forward_seconds, mfu, step_flops
from threefold.planner.hardware import PRESETS, GiB, load_gpu
from threefold.planner.memory import rank_memory
from threefold.planner.step_time import closed_form_makespan, hardware_tflops_per_gpu, step_time
from threefold.planner.workload import Strategy, Workload

A100 = PRESETS["a100-80gb"]


def gpt(heads, hidden, layers):
    """The GPT models of Narayanan et al. 2021 (vocabulary 51,200, sequence 2,048, MLP 4h)."""
    base = load_config(None, ["model.preset=gpt3-175b"]).model
    return replace(base, heads=heads, kv_heads=heads, hidden=hidden, layers=layers, ffn_hidden=4 * hidden,
                   vocab=51200, max_seq=2048)


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC'21), A100 80GB (DGX A100, NVSwitch, 8 x HDR InfiniBand per node), micro-batch 1,
# full activation recomputation, achieved TFLOP/s per GPU (recomputation included). The calibration
# set of docs/planner.md: `error` is the doc's figure, pinned so that the table stays true.
MEGATRON = [
    # (what, heads, hidden, layers, tp, pp, gpus, global batch, reported TFLOP/s per GPU, error)
    ("table 2: 174.6B (GPT-3) on 384 GPUs", 96, 12288, 96, 8, 12, 384, 1536, 153, 0.015),
    ("table 2: 174.6B (GPT-3) on 768 GPUs", 96, 12288, 96, 8, 12, 768, 1536, 149, 0.009),
    ("table 2: 174.6B (GPT-3) on 1536 GPUs", 96, 12288, 96, 8, 12, 1536, 1536, 141, 0.002),
    ("table 2: 529.6B on 560 GPUs", 128, 20480, 105, 8, 35, 560, 2240, 171, 0.034),
    ("table 2: 529.6B on 2240 GPUs", 128, 20480, 105, 8, 35, 2240, 2240, 159, 0.015),
    ("table 1: 1.7B on 32 GPUs", 24, 2304, 24, 1, 1, 32, 512, 137, 0.058),
    ("table 1: 7.5B on 128 GPUs", 32, 4096, 36, 4, 1, 128, 512, 142, -0.053),
    ("table 1: 39.1B on 512 GPUs", 64, 8192, 48, 8, 2, 512, 1536, 138, 0.014),
    ("table 1: 145.6B on 1536 GPUs", 96, 12288, 80, 8, 8, 1536, 2304, 148, -0.003),
    ("table 1: 529.6B on 2520 GPUs", 128, 20480, 105, 8, 35, 2520, 2520, 163, -0.010),
    ("table 1: 1008B on 3072 GPUs", 160, 25600, 128, 8, 64, 3072, 3072, 163, -0.000),
]


@pytest.mark.parametrize("what,heads,hidden,layers,tp,pp,gpus,batch,reported,error", MEGATRON,
                         ids=[r[0] for r in MEGATRON])
def test_published_megatron_runs_fit_and_throughput_within_25_percent(what, heads, hidden, layers, tp, pp, gpus,
                                                                      batch, reported, error):
    # Megatron-LM of 2021: no flash attention; gradients all-reduced after the pipeline flush; pipeline
    # tensors split over tp, sent batched and gathered on arrival (its scatter/gather p2p); its
    # vocabulary-parallel cross-entropy in fp32
    w = Workload(gpt(heads, hidden, layers), batch, 2048, attention="dense", grad_overlap=False,
                 pipeline_p2p="scatter-gather", loss="megatron")
    dp = gpus // (tp * pp)
    # its local DDP all-reduced the contiguous gradient buffer in one collective (megatron/model/distributed.py)
    st = Strategy(dp=dp, tp=tp, pp=pp, microbatches=batch // dp, remat="full", precision="bf16", bucket_mb=2.0**30)
    assert rank_memory(w, st, A100).total <= A100.memory_bytes
    predicted = hardware_tflops_per_gpu(w, st, step_time(w, st, A100).total_s)
    assert abs(predicted / reported - 1) <= 0.25, f"{what}: predicted {predicted:.0f} vs {reported} TFLOP/s"
    assert predicted / reported - 1 == pytest.approx(error, abs=0.002), "docs/planner.md's calibration table"


def test_flops_equal_narayanan_formula():
    # appendix of Narayanan et al. 2021: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation
    B, s, l, h, V = 1536, 2048, 96, 12288, 51200
    w = Workload(gpt(96, h, l), B, s)
    expected = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert step_flops(w, Strategy(remat="full")) == pytest.approx(expected, rel=1e-9)
    assert step_flops(w, Strategy(remat="full"), hardware=False) == pytest.approx(expected * 3 / 4, rel=0.01)


def test_mfu_is_model_flops_over_peak():
    w = Workload(gpt(96, 12288, 96), 1536, 2048)
    model_flops = step_flops(w, Strategy(), hardware=False)
    assert mfu(w, 10.0, 1024, 312e12) == pytest.approx(model_flops / (10.0 * 1024 * 312e12))


def test_collective_costs():
    link = comm.Link("x", 100e9, 0.0)
    assert comm.ring_all_reduce(8e9, 8, link) == pytest.approx(2 * 7 / 8 * 8e9 / 100e9)
    assert comm.reduce_scatter(8e9, 8, link) == comm.all_gather(8e9, 8, link) == pytest.approx(7 / 8 * 0.08)
    assert comm.all_reduce(8e9, 1, link) == 0
    slow = comm.Link("y", 100e9, 1e-3)  # latency-bound: the tree's log2(n) steps win
    assert comm.all_reduce(1e3, 512, slow) == comm.tree_all_reduce(1e3, 512, slow) < comm.ring_all_reduce(1e3, 512, slow)
    assert comm.point_to_point(1e9, slow) == pytest.approx(1e-3 + 0.01)


def test_axes_are_placed_tp_first_inside_a_node():
    h100 = PRESETS["h100-80gb"]
    assert comm.axis_link(h100, "tp", 8, 4, 8).name == "nvlink4"
    assert comm.axis_link(h100, "dp", 8, 4, 4).name == "ndr"  # dp stride 8: across nodes
    assert comm.axis_link(h100, "dp", 2, 4, 4).name == "nvlink4"  # 2 x 4 ranks share a node
    assert comm.axis_link(h100, "pp", 4, 2, 4).name == "ndr"


@pytest.mark.parametrize("schedule,expected_bubble", [("1f1b", 3 * 3), ("gpipe", 3 * 3), ("interleaved", 3 * 3 / 2),
                                                      ("zb-h1", 3 * 1)])
def test_closed_form_bubbles(schedule, expected_bubble):
    p, m, f, b, w = 4, 8, 1.0, 2.0, 1.0  # forward 1, backward 2 of which weight gradients 1
    makespan = closed_form_makespan(schedule, p, m, 2, f, b, w)
    assert makespan - m * (f + b) == pytest.approx(expected_bubble)


def test_step_time_parts_add_up_and_pipeline_costs_bubble():
    w = Workload(load_config(None, ["model.preset=llama-7b"]).model, 256, 4096)
    gpu = PRESETS["h100-80gb"]
    t = step_time(w, Strategy(dp=4, tp=2, pp=4, microbatches=8, sequence_parallel=True), gpu)
    assert t.total_s == pytest.approx(t.pipeline_s + t.dp_exposed_s + t.overlap_slowdown_s + t.optimizer_s)
    assert t.bubble_s == pytest.approx(3 * (t.forward_s + t.backward_s))
    more = step_time(w, Strategy(dp=4, tp=2, pp=4, microbatches=32, sequence_parallel=True), gpu)
    assert more.bubble_s < t.bubble_s


def test_gpu_presets_and_a_custom_toml(tmp_path):
    assert set(PRESETS) >= {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "b200-192gb"}
    assert PRESETS["h100-80gb"].peak_flops == 989e12 and PRESETS["a100-40gb"].memory_bytes == 40 * GiB
    assert PRESETS["b200-192gb"].intra_bytes_per_s > PRESETS["h100-80gb"].intra_bytes_per_s > PRESETS["a100-80gb"].intra_bytes_per_s
    path = tmp_path / "mi.toml"
    path.write_text('[gpu]\nname = "lab-gpu"\npeak_tflops = 500\nmemory_gib = 64\nhbm_tbps = 3\n'
                    'nvlink_gbps = 200\nib_gbps = 400\ngpus_per_node = 4\n')
    gpu = load_gpu(str(path))
    assert (gpu.name, gpu.peak_flops, gpu.memory_bytes, gpu.inter_bytes_per_s, gpu.gpus_per_node) == \
        ("lab-gpu", 500e12, 64 * GiB, 50e9, 4)
    path.write_text('[gpu]\npeak_tflops = 500\n')
    with pytest.raises(UserError, match="lacks"):
        load_gpu(str(path))
    with pytest.raises(UserError, match="unknown GPU kind"):
        load_gpu("v100")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_written_as_toml_reads_back_as_itself(tmp_path, name):
    """`gpu_toml` writes every field `load_gpu` reads (bench/planner_kernels.py --toml writes a measured kind so)."""
    from dataclasses import asdict

    from threefold.planner.hardware import gpu_toml

    path = tmp_path / f"{name}.toml"
    path.write_text(gpu_toml(PRESETS[name], f"{name}, as the planner has it"))
    back, want = asdict(load_gpu(str(path))), asdict(PRESETS[name])
    assert back.keys() == want.keys()
    for key, value in want.items():
        assert back[key] == (value if isinstance(value, str) else pytest.approx(value, rel=1e-12)), key


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_schedule_simulator_agrees_with_the_closed_forms(schedule, v):
    """Active once threefold.pipeline.simulate exists: uniform stages give the textbook makespans."""
    pytest.importorskip("threefold.pipeline.simulate")
    from threefold.planner.step_time import pipeline_makespan

    p, m, f, b, w = 4, 8, 1.0, 2.0, 1.0
    makespan, simulated = pipeline_makespan(schedule, p, m, v, f, b, w)
    assert simulated
    assert makespan == pytest.approx(closed_form_makespan(schedule, p, m, v, f, b, w), rel=1e-6)


# Narayanan et al. 2021, table 2: ZeRO-3 without model parallelism (DeepSpeed), 174.6B model,
# global batch 1536, full recomputation: 144, 88, 44 TFLOP/s as the per-GPU batch shrinks. DeepSpeed's ZeRO-3 of
# 2021 gathered parameter by parameter and prefetched at most 50M elements ahead - less than one of this model's
# 151M-parameter matrices - so its gathers are priced one collective per parameter tensor and not hidden
# (Workload.sharding "deepspeed-2021", planner/dp_comm.py). NCCL's rings cross a node through its 8 NICs
# (planner/comm.py Group): the model follows the collapse but stays above it, by the documented errors below
# (pinned within 2 points, docs/planner.md): the rest of the collapse is not explained by the model.
ZERO3 = [(384, 4, 144, 0.263), (768, 2, 88, 0.552), (1536, 1, 44, 0.653)]


def zero3_tflops(gpus, micro_batch, sharding="deepspeed-2021"):
    w = Workload(gpt(96, 12288, 96), 1536, 2048, attention="dense", sharding=sharding)  # DeepSpeed of 2021: no flash
    st = Strategy(dp=gpus, zero=3, microbatches=1536 // (gpus * micro_batch), remat="full")
    return hardware_tflops_per_gpu(w, st, step_time(w, st, A100).total_s)


@pytest.mark.parametrize("gpus,micro_batch,reported,error", ZERO3)
def test_zero3_without_model_parallelism_tracks_deepspeed(gpus, micro_batch, reported, error):
    predicted = zero3_tflops(gpus, micro_batch)
    assert predicted / reported - 1 == pytest.approx(error, abs=0.02), f"predicted {predicted:.0f} vs {reported}"


def test_deepspeed_2021_zero3_collapses_with_the_per_gpu_batch_where_unit_gathers_would_not():
    ours = [zero3_tflops(g, mb) for g, mb, *_ in ZERO3]
    assert ours[0] > ours[1] > ours[2] and ours[2] < 0.5 * ours[0]
    units = [zero3_tflops(g, mb, "threefold") for g, mb, *_ in ZERO3]  # a unit per block, prefetched
    assert units[2] > 0.85 * units[0]  # 211 / 203 / 186: the hidden gathers slow the compute beside them


def test_a_flash_kernel_is_charged_half_the_causal_attention():
    m = load_config(None, ["model.preset=llama-7b"]).model
    # the flat share of the peak (a published attention table: tests/unit/test_planner_kernels.py)
    st, gpu = Strategy(remat="selective"), replace(PRESETS["h100-80gb"], attention_table="")
    flash, dense = (step_time(Workload(m, 8, 8192, attention=a), st, gpu) for a in ("flash", "dense"))
    assert flash.total_s < dense.total_s  # the dense kernel computes the masked half and moves the scores
    # the fused kernel's time is its executed FLOPs (half of the counted 4 s h per token) at attention_efficiency
    slower = replace(gpu, attention_efficiency=gpu.attention_efficiency / 2)
    one, two = (block_forward_seconds(m, 1, 8192, 1, False, "flash", g, "bf16")[0] for g in (gpu, slower))
    executed = 0.5 * 4 * 8192 * m.attn_width * 8192
    assert two - one == pytest.approx(executed / (gpu.flops("bf16") * gpu.attention_efficiency
                                                  * gpu.compute_efficiency), rel=1e-9)
    assert step_flops(Workload(m, 8, 8192, attention="flash"), st) == step_flops(Workload(m, 8, 8192), st)


def test_zero1_parameter_gathers_overlap_the_next_forward_only_without_a_pipeline():
    from threefold.planner.dp_comm import data_parallel
    from threefold.planner.workload import rank_parameters

    w = Workload(load_config(None, ["model.preset=llama-7b"]).model, 64, 2048)
    n = rank_parameters(w.model, 1, 1, 0).total
    group = comm.group(A100, 1, 16)  # 16 ranks on 2 nodes: NCCL's ring crosses nodes on 1 of its 15 steps
    buckets = math.ceil(2 * n / (25 * 2**20))  # 25 MiB buckets of bf16 gradients, a collective each
    rs, ag = (buckets * op(2 * n / buckets, group) for op in (comm.group_reduce_scatter, comm.group_all_gather))
    step_latency = 14 * A100.intra_latency_s + A100.inter_latency_s
    assert rs == pytest.approx(comm.group_reduce_scatter(2 * n, group) + (buckets - 1) * step_latency)
    st = Strategy(dp=16, zero=1, microbatches=4)
    # the reduce-scatters bucket by bucket as the gradients are ready (dp_comm.bucket_tail): at most the
    # backward's first (n - 1)/n hides them, and never the last bucket
    tail = max(rs / buckets, rs - 0.1 * (buckets - 1) / buckets)
    assert data_parallel(w, st, A100, 0, 0.1, 0.05) == pytest.approx((rs + ag, tail + ag - 0.05))
    assert data_parallel(replace(w, grad_overlap=False), st, A100, 0, 0.1, 0.05) == pytest.approx((rs + ag, rs + ag))
    n2 = rank_parameters(w.model, 1, 2, 0).total
    group2 = comm.group(A100, 1, 8)
    st2 = Strategy(dp=8, pp=2, zero=1, microbatches=4)  # the gathers wait right after the step
    buckets2 = math.ceil(2 * n2 / (25 * 2**20))
    ag2 = buckets2 * comm.group_all_gather(2 * n2 / buckets2, group2)
    rs2 = buckets2 * comm.group_reduce_scatter(2 * n2 / buckets2, group2)
    assert data_parallel(w, st2, A100, 0, 1e9, 1e9)[1] == pytest.approx(ag2 + rs2 / buckets2)  # the last bucket
