"""threefold context parallelism against torch's `context_parallel`, side by side (CPU, gloo).

The workload: one causal attention forward+backward, fp32, batch 1, 8 heads of 64, at cp = 2 on
2 gloo processes (1 thread each), for each sequence length. The same q, k, v and output gradient
on both sides, in the same layout: torch's default load balancer (head-tail) gives rank i chunks i
and 2cp-1-i of 2cp, which is threefold's zigzag split (checked on every rank), so both sides get
the same local tensors and their local outputs and gradients are compared directly.

    threefold  `ring_attention` and `allgather_attention` over the mesh's cp axis (parallel/context.py)
    torch      `torch.distributed.tensor.experimental.context_parallel` on the mesh's cp DeviceMesh,
               `F.scaled_dot_product_attention(q, k, v, is_causal=True)` inside it (load balancing on:
               torch's default for causal), rotate method allgather (torch's default) and alltoall
               (`_attention.set_rotate_method`); the SDPA backend torch picks by default on CPU

Pairs compared: threefold ring / torch alltoall (K,V passed around the ring, cp-1 hops), threefold
allgather / torch allgather (K,V gathered in one collective). Timed rounds run one iteration of
every side, the order reversed every other round, so load from other processes falls on all sides
alike; the time of an iteration is the slowest rank's. Prints median and quartiles of the
per-iteration time, the ratio threefold / torch per pair (median and quartiles of the per-round
ratios; below 1: threefold faster), the relative error of output and gradients between the two
sides of each pair, threefold's bytes sent per rank and iteration, and the load average at start
and end. A side torch cannot run here prints its exception, and threefold's sides run alone (the
ring is then checked against threefold's allgather instead).

    PYTHONPATH=src python bench/context_vs_torch.py [--seq-lens 2048,8192] [--rounds 10] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

B, HEADS, HEAD_DIM = 1, 8, 64
PAIRS = (("ring", "alltoall"), ("allgather", "allgather"))  # (threefold method, torch rotate method)
TORCH_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")  # what each explicit choice gives


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def run_rank(seq_lens: list[int], rounds: int) -> dict:
    import torch.distributed as dist

    from threefold.comm import Comm
    from threefold.mesh import Layout, Mesh
    from threefold.parallel.context import allgather_attention, ring_attention, zigzag_index, zigzag_split

    cp = dist.get_world_size()
    mesh = Mesh(Layout(cp=cp), torch.device("cpu"))
    comm = Comm(mesh)
    rank = mesh.rank("cp")
    device_mesh = mesh.device_mesh["cp"]
    result: dict = {"torch_error": {}, "backend_errors": {}, "seq": {}}

    try:  # torch's API; an older or newer torch without it reports why here
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
        result["load_balance"] = bool(_cp_options.enable_load_balance)
    except Exception as e:
        context_parallel = set_rotate_method = None
        for _, rotate in PAIRS:
            result["torch_error"][rotate] = _first_line(e)

    def torch_attention(q, k, v, do, seq, rotate, backend=None):
        """torch's context parallelism as its users write it: the sequence buffers sharded by the context
        manager (here the positions, which then show the layout), SDPA called inside it."""
        from contextlib import nullcontext

        from torch.nn.attention import SDPBackend, sdpa_kernel

        set_rotate_method(rotate)
        positions = torch.arange(seq)[None]
        with context_parallel(device_mesh, buffers=[positions], buffer_seq_dims=[1]):
            layout = positions.clone()
            with sdpa_kernel(getattr(SDPBackend, backend)) if backend else nullcontext():
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.backward(do)
        return y, layout

    for seq in seq_lens:
        gen = torch.Generator().manual_seed(seq)
        full = [torch.randn(B, HEADS, seq, HEAD_DIM, generator=gen) for _ in range(4)]
        q, k, v, do = (zigzag_split(x, cp, rank, dim=2).contiguous() for x in full)
        del full
        index = zigzag_index(seq, cp, rank)

        def leaves():
            return [x.clone().requires_grad_() for x in (q, k, v)]

        def threefold_side(method):
            attention = ring_attention if method == "ring" else allgather_attention

            def step():
                ql, kl, vl = leaves()
                y = attention(ql, kl, vl, comm, "cp", index)
                y.backward(do)
                return [y.detach(), ql.grad, kl.grad, vl.grad]
            return step

        def torch_side(rotate):
            def step():
                ql, kl, vl = leaves()
                y, _ = torch_attention(ql, kl, vl, do, seq, rotate)
                return [y.detach(), ql.grad, kl.grad, vl.grad]
            return step

        sides = {f"threefold {m}": threefold_side(m) for m, _ in PAIRS}
        first: dict[str, list] = {}
        per_seq: dict = {"bytes": {}}
        for name, step in list(sides.items()):  # warm-up, the bytes of one iteration, the outputs compared
            comm.traffic.take_window()
            first[name] = step()
            per_seq["bytes"][name] = sum(comm.traffic.take_window().get("cp", {}).values())
        for _, rotate in PAIRS:
            if rotate in result["torch_error"] or context_parallel is None:
                continue
            name = f"torch {rotate}"
            try:
                ql, kl, vl = leaves()
                y, layout = torch_attention(ql, kl, vl, do, seq, rotate)
                if not torch.equal(layout[0], index):
                    raise AssertionError(f"torch's load-balanced shard is not the zigzag split on rank {rank}")
                first[name] = [y.detach(), ql.grad, kl.grad, vl.grad]
                sides[name] = torch_side(rotate)
            except Exception as e:  # print, do not hide, what torch's context parallelism cannot do here
                result["torch_error"][rotate] = _first_line(e)
        if result["torch_error"] and not result["backend_errors"] and context_parallel is not None:
            for backend in TORCH_BACKENDS:  # the explicit SDPA backend choices, at a small size: why each fails
                small = [x[:, :, :32].contiguous() for x in (q, k, v, do)]
                try:
                    torch_attention(*[x.requires_grad_() for x in small[:3]], small[3], 32 * cp, "allgather", backend)
                    result["backend_errors"][backend] = "ran"
                except Exception as e:
                    result["backend_errors"][backend] = _first_line(e)
            set_rotate_method("allgather")

        errors = {}
        for ours, rotate in PAIRS:
            theirs = f"torch {rotate}" if f"torch {rotate}" in first else "threefold allgather"
            if theirs != f"threefold {ours}":
                errors[(f"threefold {ours}", theirs)] = [rel_err(a, b) for a, b in
                                                         zip(first[f"threefold {ours}"], first[theirs])]
        per_seq["rel_err"] = errors
        del first

        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                comm.barrier("cp")
                start = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - start)
        per_seq["times"] = times
        result["seq"][seq] = per_seq
    return result


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def main() -> None:
    from threefold.launch.world import World

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq-lens", default="2048,8192")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="seq 256, 2 rounds: the script end to end in seconds")
    a = parser.parse_args()
    seq_lens, rounds = ([256], 2) if a.smoke else ([int(s) for s in a.seq_lens.split(",")], a.rounds)
    start_load = os.getloadavg()
    wall = time.monotonic()
    print(f"causal attention forward+backward, fp32, batch {B}, {HEADS} heads of {HEAD_DIM}, cp={a.cp} on {a.cp} "
          f"gloo processes (CPU, 1 thread each), torch {torch.__version__}")
    print("load average at start: " + ", ".join(f"{x:.1f}" for x in start_load) + " (1, 5, 15 min)")
    with World(a.cp, timeout_s=3600) as world:
        ranks = world.run(run_rank, seq_lens, rounds)
    r0 = ranks[0]
    for rotate, error in r0["torch_error"].items():
        print(f"torch context_parallel, rotate method {rotate}: did not run on CPU/gloo: {error}")
    for backend, error in r0["backend_errors"].items():
        print(f"  with sdpa_kernel(SDPBackend.{backend}): {error}")
    print(f"{rounds} rounds, one iteration of every side each, the order reversed every other round; "
          f"seconds per iteration (slowest rank), median [q1, q3]; bytes sent per rank and iteration")
    print(f"{'seq':>6}  {'side':<22}{'median s':>10}  {'[q1, q3]':<20}{'bytes':>12}")
    for seq in seq_lens:
        names = list(r0["seq"][seq]["times"])
        slowest = {n: [max(r["seq"][seq]["times"][n][i] for r in ranks) for i in range(rounds)] for n in names}
        for n in names:
            q1, med, q3 = quartiles(slowest[n])
            sent = r0["seq"][seq]["bytes"].get(n)
            spread = f"[{q1:.3f}, {q3:.3f}]"
            sent = f"{sent:,d}" if sent is not None else "-"
            print(f"{seq:>6}  {n:<22}{med:>10.3f}  {spread:<20}{sent:>12}")
        for ours, rotate in PAIRS:
            mine, theirs = f"threefold {ours}", f"torch {rotate}"
            if theirs in slowest:
                q1, med, q3 = quartiles([x / y for x, y in zip(slowest[mine], slowest[theirs])])
                print(f"{seq:>6}  ratio {mine} / {theirs}: {med:.2f} [{q1:.2f}, {q3:.2f}]")
        for (mine, theirs), _ in r0["seq"][seq]["rel_err"].items():
            worst = [max(r["seq"][seq]["rel_err"][(mine, theirs)][i] for r in ranks) for i in range(4)]
            print(f"{seq:>6}  rel err {mine} vs {theirs} (out, dq, dk, dv; worst rank): "
                  + " ".join(f"{e:.1e}" for e in worst))
    print("load average at end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
          + f"; wall {time.monotonic() - wall:.0f} s")


if __name__ == "__main__":
    main()
