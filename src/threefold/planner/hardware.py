"""GPU kinds the planner knows: compute peak, memory, and the two levels of the network.

Numbers are per GPU. Bandwidths are bytes per second in one direction (what one GPU can push
while it also receives at the same rate), which is what the alpha-beta formulas in comm.py use.
A custom kind is read from a TOML file (see `load_gpu`).

Sources (vendor data sheets):
  A100: NVIDIA A100 Tensor Core GPU data sheet (2021) - 312 TFLOP/s dense BF16, HBM2e 1,555 GB/s
        (40GB) / 2,039 GB/s (80GB SXM), NVLink 3 at 600 GB/s total (12 links x 50 GB/s); DGX A100
        user guide: 6 NVSwitch (gen 2), 8 x HDR 200 Gb/s InfiniBand ports per node.
  H100: NVIDIA H100 Tensor Core GPU data sheet (SXM5) - 989 TFLOP/s dense BF16 (1,979 with
        sparsity), HBM3 3.35 TB/s, NVLink 4 at 900 GB/s total (18 links x 50 GB/s); DGX H100: NVSwitch
        gen 3, 8 x ConnectX-7 NDR 400 Gb/s.
  H200: NVIDIA H200 data sheet (SXM) - same compute as H100, 141 GB HBM3e at 4.8 TB/s, NVLink 4.
  B200: NVIDIA DGX B200 / HGX B200 data sheet - 2.25 PFLOP/s dense BF16 per GPU (4.5 with
        sparsity), HBM3e 8 TB/s, 180 GB usable per GPU in DGX B200 (1,440 GB per node; 192 GB
        physical), NVLink 5 at 1.8 TB/s total, NVSwitch gen 4, 8 x ConnectX-7 400 Gb/s.
  H800: NVIDIA H800 SXM5 (the H100 die for export markets) - the H100 SXM's 989 TFLOP/s dense BF16
        and 80 GB HBM3 at 3.35 TB/s, NVLink cut to 400 GB/s total (NVIDIA H800 product brief; also
        DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, section 3.1: "each node in the
        H800 cluster contains 8 GPUs connected by NVLink and NVSwitch within nodes", InfiniBand across
        nodes; section 3.2.2: "IB (50 GB/s)" per GPU across nodes, "NVLink (160 GB/s)" achieved inside
        one; and DeepSeek-AI, "Insights into DeepSeek-V3", arXiv:2505.09343, section 5: eight 400 Gb/s
        ConnectX-7 InfiniBand NICs per node, one per GPU).
  FP8: the same data sheets' dense FP8 tensor-core peaks (H100 / H200 / H800 SXM 1,979 TFLOP/s, twice
        the BF16 peak; B200 4.5 PFLOP/s); the A100 has none (`fp8_flops` 0). How a linear's fp8 GEMMs
        and casts compare with its bf16 GEMMs: planner/compute.py `fp8_linear_seconds`.
  InfiniBand generations: EDR 100, HDR 200, NDR 400, XDR 800 Gb/s per port (InfiniBand Trade
        Association roadmap); one port per GPU as in the DGX nodes above.
  Other networks (`NETWORKS`, `threefold plan --network NAME`): each entry names its source.

Matrix-multiplication speed depends on the shapes (planner/compute.py, `gemm_seconds`): each GEMM
runs at `peak x gemm_efficiency x (tile and wave quantization of its M x N output over `sms`
multiprocessors)`, or at the HBM roofline when its arithmetic intensity is below peak / bandwidth;
a fused causal attention kernel at `peak x attention_efficiency`. Sources:
  sms: A100 whitepaper (108 SMs), H100 whitepaper (132 SMs in the SXM5 part, as in H200), Blackwell
        B200 (148 SMs, two dies of 74).
  gemm_efficiency: the share of the dense peak cuBLAS reaches on large, well-aligned BF16 GEMMs,
        from published measurements: A100 ~250 of 312 TFLOP/s (NVIDIA, "Matrix Multiplication
        Background User's Guide", the large-GEMM plateau of its A100 figures: 0.8), H100 SXM ~700-750
        of 989 (0.72-0.76, power-limited clocks under dense tensor-core load; 0.74), B200 assumed the
        same share as H100 (0.74; no independent measurement at hand).
  attention_efficiency: FlashAttention-2 (Dao 2023) reports 50-73% of the A100's peak forward and
        ~60% in backward (0.6); B200 0.55 (no published table at hand). Kinds with a published table
        (`attention_table`, planner/kernel_data.py) take its measured TFLOP/s instead: the Hopper presets
        FlashAttention-2's on H100 SXM5 (Shah et al. 2024, FlashAttention-3, figures 5 and 6), the A100
        presets FlashAttention-2's on A100 SXM4 (Dao 2023, its forward + backward figure: 155 TFLOP/s at 2k
        causal keys, where 0.6 of the peak gave 218), the kernel PyTorch's SDPA runs first.
  gemm_fixed_s: seconds each GEMM costs beyond its FLOPs, fitted to XLA's measured H100 table
        (planner/kernel_data.py) with the plateau above held; the Hopper presets only (0 elsewhere).
  overlap_slowdown: how much longer compute takes while a collective runs beside it (NCCL's kernels hold
        multiprocessors - an all-gather's 24 CTAs of an H100's 132 SMs - and share HBM bandwidth): 0.189, the
        average computational slowdown Lee et al. measured when compute and communication overlap on A100 and H100
        (GPT and LLaMA layers; "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
        Learning: Performance and Power Implications", arXiv:2507.03114, 2025: 18.9% on average, 40% at most).
        Published, not fitted; the same for every preset. Priced on the data-parallel / ZeRO collectives the step
        hides behind compute (planner/step_time.py `overlap_interference`).
  Tiles and waves follow the same guide (its sections "Tile Quantization" and "Wave Quantization":
        an output tile of 256 x 128 per SM is the most efficient, a GEMM whose tiles fill the SMs
        unevenly runs its last wave partly idle).

`compute_efficiency` is the one fitted constant, the same for every preset: the share of that
kernel-level time a real training loop achieves (launch gaps, kernels not modelled such as
fused epilogues, stream synchronisations). It was set on the calibration set only
(Narayanan et al. 2021, A100; docs/planner.md "Calibration set"); the Hopper and Blackwell
presets differ from the A100 only through their vendor numbers and the published kernel shares
above, not through a constant set on an H100 run.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..errors import UserError
from .kernel_data import ATTENTION, H100_GEMM_FIXED_S

GiB = 2**30
GB = 10**9

# InfiniBand data rates per port, bits per second.
INFINIBAND_GBPS = {"edr": 100, "hdr": 200, "ndr": 400, "xdr": 800}

# NVLink generations: total (both directions) bandwidth per GPU in GB/s.
NVLINK_TOTAL_GBPS = {"nvlink3": 600, "nvlink4": 900, "nvlink5": 1800}


@dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense BF16/FP16 tensor-core FLOP/s
    memory_bytes: int
    hbm_bytes_per_s: float
    nvlink: str  # generation name, for display
    intra_bytes_per_s: float  # NVLink/NVSwitch, one direction, per GPU
    inter_bytes_per_s: float  # InfiniBand, one direction, per GPU
    infiniband: str = "ndr"
    gpus_per_node: int = 8
    intra_latency_s: float = 5e-6  # per message step of a collective inside a node
    inter_latency_s: float = 12e-6  # per message step across nodes
    link_efficiency: float = 0.8  # achievable share of the nominal link rate (NCCL bus bandwidth)
    compute_efficiency: float = 0.93  # see the module docstring: the one fitted constant, every preset
    sms: int = 108  # streaming multiprocessors, for wave quantization
    gemm_efficiency: float = 0.8  # share of the dense peak a large, well-shaped GEMM reaches
    attention_efficiency: float = 0.6  # share of the dense peak a fused (flash) attention kernel reaches
    fp32_flops: float = 0.0  # non-tensor-core FP32 peak, for --precision fp32 (0: peak / 16)
    op_overhead_s: float = 4e-6  # host seconds to dispatch and launch one operator (planner/dispatch.py)
    fp8_flops: float = 0.0  # dense FP8 tensor-core peak (0: no fp8 tensor cores; --precision fp8 gains nothing)
    gemm_fixed_s: float = 0.0  # seconds every GEMM costs beyond its FLOPs (planner/kernel_data.py; 0: no table)
    attention_table: str = ""  # published fused-attention table (kernel_data.ATTENTION); "": attention_efficiency
    overlap_slowdown: float = 0.189  # compute's slowdown beside a running collective (Lee et al. 2025; docstring)

    def flops(self, precision: str) -> float:
        if precision == "fp32":
            return self.fp32_flops or self.peak_flops / 16
        return self.peak_flops


def fp8_gpu(device_name: str) -> Gpu | None:
    """The preset of a CUDA device by its name (torch.cuda.get_device_name: "NVIDIA H200", ...), for the
    fp8 auto rule; None for a GPU without a known fp8 peak (then no linear converts under auto)."""
    name = device_name.lower()
    for key, preset in (("h200", "h200-141gb"), ("h800", "h800-80gb"), ("h100", "h100-80gb"), ("b200", "b200-192gb")):
        if key in name:
            return PRESETS[preset]
    return None


def _nvlink(gen: str) -> float:
    return NVLINK_TOTAL_GBPS[gen] / 2 * GB  # one direction


def _ib(gen: str) -> float:
    return INFINIBAND_GBPS[gen] / 8 * GB


# the Hopper presets' published kernel tables (planner/kernel_data.py): the H100 SXM's GEMM fixed cost and the
# attention kernel PyTorch's SDPA runs there (FlashAttention-2); the H200 and H800 share the H100's compute
_HOPPER_KERNELS = dict(gemm_fixed_s=H100_GEMM_FIXED_S, attention_table="h100/fa2")

PRESETS: dict[str, Gpu] = {
    "a100-40gb": Gpu("a100-40gb", 312e12, 40 * GiB, 1555 * GB, "nvlink3", _nvlink("nvlink3"), _ib("hdr"),
                     infiniband="hdr", fp32_flops=19.5e12, attention_table="a100/fa2"),
    "a100-80gb": Gpu("a100-80gb", 312e12, 80 * GiB, 2039 * GB, "nvlink3", _nvlink("nvlink3"), _ib("hdr"),
                     infiniband="hdr", fp32_flops=19.5e12, attention_table="a100/fa2"),
    "h100-80gb": Gpu("h100-80gb", 989e12, 80 * GiB, 3350 * GB, "nvlink4", _nvlink("nvlink4"), _ib("ndr"),
                     infiniband="ndr", fp32_flops=67e12, sms=132,
                     gemm_efficiency=0.74, attention_efficiency=0.55, fp8_flops=1979e12, **_HOPPER_KERNELS),
    "h200-141gb": Gpu("h200-141gb", 989e12, 141 * GiB, 4800 * GB, "nvlink4", _nvlink("nvlink4"), _ib("ndr"),
                      infiniband="ndr", fp32_flops=67e12, sms=132,
                      gemm_efficiency=0.74, attention_efficiency=0.55, fp8_flops=1979e12, **_HOPPER_KERNELS),
    # the H100 SXM's compute and HBM, NVLink 400 GB/s, one 400 Gb/s InfiniBand NIC per GPU (module docstring)
    "h800-80gb": Gpu("h800-80gb", 989e12, 80 * GiB, 3350 * GB, "nvlink4 (h800)", 400 / 2 * GB, _ib("ndr"),
                     infiniband="ndr", fp32_flops=67e12, sms=132,
                     gemm_efficiency=0.74, attention_efficiency=0.55, fp8_flops=1979e12, **_HOPPER_KERNELS),
    "b200-192gb": Gpu("b200-192gb", 2250e12, 180 * GiB, 8000 * GB, "nvlink5", _nvlink("nvlink5"), _ib("ndr"),
                      infiniband="ndr", fp32_flops=80e12, sms=148,
                      gemm_efficiency=0.74, attention_efficiency=0.55, fp8_flops=4500e12),
}


@dataclass(frozen=True)
class Network:
    """An inter-node network as the planner sees it: the rate one GPU can push across nodes (its NIC, or
    its share of the node's NICs) and the latency of one collective step over it."""

    name: str
    kind: str  # InfiniBand | RoCE | EFA (display)
    gbps: float  # per GPU, Gb/s (bits) in one direction
    latency_s: float = 12e-6  # one step of a collective across nodes (the Gpu default: no per-network source)
    source: str = ""

    def describe(self) -> str:
        return f"{self.name} ({self.kind}, {self.gbps:g} Gb/s per GPU)"


# Inter-node networks (`threefold plan --network NAME`, or `network = "NAME"` in a GPU's TOML table).
# Rates are per GPU in one direction. No source gives a per-network latency of one NCCL step, so every
# entry keeps the Gpu default (12 us); the achievable share of the rate stays the GPU kind's
# `link_efficiency` (NCCL's bus bandwidth over the nominal rate).
#   InfiniBand: InfiniBand Trade Association roadmap (https://www.infinibandta.org/infiniband-roadmap/):
#     EDR 100, HDR 200, NDR 400, XDR 800 Gb/s per 4x port; DGX A100 has 8 HDR and DGX H100 8 NDR ports
#     for 8 GPUs (https://docs.nvidia.com/dgx/dgxa100-user-guide/introduction-to-dgxa100.html,
#     https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html).
#   RoCE: RDMA over Ethernet, one NIC per GPU as in Meta's Llama 3 clusters, 400 Gb/s per GPU
#     (Gangidi et al., "RDMA over Ethernet for Distributed AI Training at Meta Scale", SIGCOMM 2024;
#     https://engineering.fb.com/2024/08/05/data-center-engineering/roce-network-distributed-ai-training-at-scale/),
#     and the 200 GbE generation (ConnectX-6 Dx, https://www.nvidia.com/en-us/networking/ethernet/connectx-6-dx/).
#   EFA: AWS Elastic Fabric Adapter. p4d.24xlarge: 400 Gb/s per instance of 8 A100, 50 Gb/s per GPU
#     (https://aws.amazon.com/blogs/compute/amazon-ec2-p4d-instances-deep-dive/); p5.48xlarge: up to
#     3,200 Gb/s over 32 network cards per instance of 8 H100, 400 Gb/s per GPU
#     (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html).
_IBTA = "InfiniBand Trade Association roadmap; one port per GPU as in DGX A100 / DGX H100"
NETWORKS: dict[str, Network] = {n.name: n for n in (
    Network("ib-edr", "InfiniBand", 100, source=_IBTA),
    Network("ib-hdr", "InfiniBand", 200, source=_IBTA),
    Network("ib-ndr", "InfiniBand", 400, source=_IBTA),
    Network("ib-xdr", "InfiniBand", 800, source=_IBTA),
    Network("roce-200", "RoCE", 200, source="200 GbE RoCE, one NIC per GPU (ConnectX-6 Dx generation)"),
    Network("roce-400", "RoCE", 400, source="400 GbE RoCE, one NIC per GPU (Meta, SIGCOMM 2024: Llama 3 clusters)"),
    Network("efa-p4d", "EFA", 400 / 8, source="AWS p4d.24xlarge: 400 Gb/s EFA per instance of 8 GPUs"),
    Network("efa-p5", "EFA", 3200 / 8, source="AWS p5.48xlarge: 3,200 Gb/s EFA per instance of 8 GPUs"),
)}


def network(name: str, flag: str = "--network") -> Network:
    """The network `name`; UserError (one line, the choices) for an unknown one."""
    if name not in NETWORKS:
        raise UserError(f"{flag}: unknown network '{name}'; choose one of {', '.join(NETWORKS)}")
    return NETWORKS[name]


def with_network(gpu: Gpu, net: Network) -> Gpu:
    """`gpu` with its inter-node links replaced by `net`'s rate and latency."""
    return replace(gpu, inter_bytes_per_s=net.gbps / 8 * GB, inter_latency_s=net.latency_s, infiniband=net.name)


def network_of(gpu: Gpu) -> Network | None:
    """The named network of `gpu` (a preset's InfiniBand generation, or one set by name), else None."""
    net = NETWORKS.get(gpu.infiniband) or NETWORKS.get(f"ib-{gpu.infiniband}")
    return net if net is not None and abs(net.gbps / 8 * GB - gpu.inter_bytes_per_s) < 1 else None


def network_label(gpu: Gpu) -> str:
    """How the table's header names the inter-node network."""
    return f"{gpu.infiniband} InfiniBand" if gpu.infiniband in INFINIBAND_GBPS else gpu.infiniband


# Keys of a custom GPU's TOML table [gpu] and what they mean (units in the name).
TOML_KEYS = {
    "name": "display name",
    "peak_tflops": "dense BF16 tensor-core TFLOP/s",
    "memory_gib": "memory per GPU in GiB",
    "hbm_tbps": "memory bandwidth in TB/s",
    "nvlink": "intra-node link name (display)",
    "nvlink_gbps": "intra-node bandwidth per GPU, GB/s in one direction",
    "infiniband": "inter-node network name (display)",
    "ib_gbps": "inter-node bandwidth per GPU, Gb/s (bits) in one direction",
    "network": "a named inter-node network (NETWORKS) instead of ib_gbps: its rate and latency",
    "gpus_per_node": "GPUs joined by the intra-node link",
    "compute_efficiency": "achieved share of the modelled kernel time in a training loop (default 0.93)",
    "sms": "streaming multiprocessors, for the GEMM wave quantization (default 108)",
    "gemm_efficiency": "share of the dense peak a large GEMM reaches (default 0.8)",
    "attention_efficiency": "share of the dense peak a fused attention kernel reaches (default 0.6)",
    "link_efficiency": "achievable fraction of link rates (default 0.8)",
    "intra_latency_us": "latency of one collective step inside a node, microseconds",
    "inter_latency_us": "latency of one collective step across nodes, microseconds",
    "op_overhead_us": "host time to dispatch and launch one operator, microseconds (default 4)",
    "fp32_tflops": "non-tensor-core FP32 TFLOP/s, for --precision fp32 (default: peak_tflops / 16)",
    "fp8_tflops": "dense FP8 tensor-core TFLOP/s (default 0: no fp8 tensor cores)",
    "gemm_fixed_us": "microseconds every GEMM costs beyond its FLOPs (default 0)",
    "overlap_slowdown": "compute's slowdown while a collective overlaps it, 0 for none (default 0.189)",
    "attention_table": f"a published fused-attention table ({', '.join(ATTENTION)}); default none: "
                       "attention_efficiency",
}


def gpu_table(gpu: Gpu) -> dict:
    """The [gpu] table of a TOML file that `load_gpu` reads back as `gpu` (every key of TOML_KEYS but
    `network`, whose rate and latency are written out): a preset to edit, or a measured kind
    (bench/planner_kernels.py --toml)."""
    return {"name": gpu.name, "peak_tflops": gpu.peak_flops / 1e12, "memory_gib": gpu.memory_bytes / GiB,
            "hbm_tbps": gpu.hbm_bytes_per_s / 1e12, "nvlink": gpu.nvlink, "nvlink_gbps": gpu.intra_bytes_per_s / GB,
            "infiniband": gpu.infiniband, "ib_gbps": gpu.inter_bytes_per_s * 8 / GB, "gpus_per_node": gpu.gpus_per_node,
            "compute_efficiency": gpu.compute_efficiency, "sms": gpu.sms, "gemm_efficiency": gpu.gemm_efficiency,
            "attention_efficiency": gpu.attention_efficiency, "link_efficiency": gpu.link_efficiency,
            "intra_latency_us": gpu.intra_latency_s * 1e6, "inter_latency_us": gpu.inter_latency_s * 1e6,
            "op_overhead_us": gpu.op_overhead_s * 1e6, "overlap_slowdown": gpu.overlap_slowdown,
            **({"fp32_tflops": gpu.fp32_flops / 1e12} if gpu.fp32_flops else {}),
            **({"fp8_tflops": gpu.fp8_flops / 1e12} if gpu.fp8_flops else {}),
            **({"gemm_fixed_us": gpu.gemm_fixed_s * 1e6} if gpu.gemm_fixed_s else {}),
            **({"attention_table": gpu.attention_table} if gpu.attention_table else {})}


def gpu_toml(gpu: Gpu, comment: str = "") -> str:
    """`gpu_table(gpu)` as the text of a TOML file (numbers as Python writes them, names as JSON strings)."""
    lines = [f"# {line}" for line in comment.splitlines()] + ["[gpu]"]
    for key, value in gpu_table(gpu).items():
        lines.append(f"{key} = {json.dumps(value) if isinstance(value, str) else repr(value)}")
    return "\n".join(lines) + "\n"


def load_gpu(kind: str) -> Gpu:
    """A preset by name, or a custom GPU from a TOML file with a [gpu] table (keys: TOML_KEYS)."""
    if kind in PRESETS:
        return PRESETS[kind]
    path = Path(kind)
    if not path.suffix == ".toml":
        raise UserError(f"--gpu: unknown GPU kind '{kind}'; choose one of {', '.join(PRESETS)} "
                        "or give a .toml file with a [gpu] table")
    if not path.is_file():
        raise UserError(f"--gpu: file '{kind}' does not exist")
    try:
        table = tomllib.loads(path.read_text()).get("gpu")
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"--gpu: '{kind}' is not valid TOML ({e})") from None
    if not isinstance(table, dict):
        raise UserError(f"--gpu: '{kind}' has no [gpu] table; keys: {', '.join(TOML_KEYS)}")
    unknown = set(table) - set(TOML_KEYS)
    if unknown:
        raise UserError(f"--gpu: unknown key(s) {', '.join(sorted(unknown))} in '{kind}'; valid: {', '.join(TOML_KEYS)}")
    net = network(str(table["network"]), f"--gpu: network in '{kind}'") if "network" in table else None
    required = ["peak_tflops", "memory_gib", "hbm_tbps", "nvlink_gbps"] + ([] if net else ["ib_gbps"])
    missing = [k for k in required if k not in table]
    if missing:
        raise UserError(f"--gpu: '{kind}' lacks {', '.join(missing)} in its [gpu] table")
    for key, value in table.items():
        if key not in ("name", "nvlink", "infiniband", "network", "attention_table") \
                and (not isinstance(value, (int, float)) or value < 0 or value == 0 and key != "overlap_slowdown"):
            raise UserError(f"--gpu: {key} in '{kind}' must be a positive number, got {value!r}")
    attention_table = str(table.get("attention_table", ""))
    if attention_table and attention_table not in ATTENTION:
        raise UserError(f"--gpu: attention_table '{attention_table}' in '{kind}' is not a published table; "
                        f"choose one of {', '.join(ATTENTION)} or leave it out")
    defaults = {f.name: f.default for f in fields(Gpu)}
    gpu = Gpu(
        name=str(table.get("name", path.stem)),
        peak_flops=table["peak_tflops"] * 1e12,
        memory_bytes=int(table["memory_gib"] * GiB),
        hbm_bytes_per_s=table["hbm_tbps"] * 1e12,
        nvlink=str(table.get("nvlink", "custom")),
        intra_bytes_per_s=table["nvlink_gbps"] * GB,
        inter_bytes_per_s=table.get("ib_gbps", net.gbps if net else 0) / 8 * GB,
        infiniband=str(table.get("infiniband", "custom")),
        gpus_per_node=int(table.get("gpus_per_node", defaults["gpus_per_node"])),
        intra_latency_s=table.get("intra_latency_us", defaults["intra_latency_s"] * 1e6) * 1e-6,
        inter_latency_s=table.get("inter_latency_us", defaults["inter_latency_s"] * 1e6) * 1e-6,
        link_efficiency=float(table.get("link_efficiency", defaults["link_efficiency"])),
        compute_efficiency=float(table.get("compute_efficiency", defaults["compute_efficiency"])),
        sms=int(table.get("sms", defaults["sms"])),
        gemm_efficiency=float(table.get("gemm_efficiency", defaults["gemm_efficiency"])),
        attention_efficiency=float(table.get("attention_efficiency", defaults["attention_efficiency"])),
        op_overhead_s=table.get("op_overhead_us", defaults["op_overhead_s"] * 1e6) * 1e-6,
        fp32_flops=table.get("fp32_tflops", defaults["fp32_flops"] / 1e12) * 1e12,
        fp8_flops=table.get("fp8_tflops", defaults["fp8_flops"] / 1e12) * 1e12,
        gemm_fixed_s=table.get("gemm_fixed_us", 0.0) * 1e-6,
        attention_table=attention_table,
        overlap_slowdown=float(table.get("overlap_slowdown", defaults["overlap_slowdown"])),
    )
    if net is not None and "ib_gbps" not in table and "inter_latency_us" not in table:
        gpu = with_network(gpu, net)
    elif net is not None:  # the table's own keys refine the named network
        gpu = replace(gpu, infiniband=str(table.get("infiniband", net.name)))
    return gpu


# A CPU "device" for predicting the memory of CPU runs: no allocator margin, nothing reserved.
CPU = Gpu("cpu", 1e11, 1 << 40, 2e10, "none", 1e10, 1e10, infiniband="none", gpus_per_node=1 << 20,
          compute_efficiency=1.0, fp32_flops=1e11, op_overhead_s=2e-6, sms=1, gemm_efficiency=1.0,
          attention_efficiency=1.0)
