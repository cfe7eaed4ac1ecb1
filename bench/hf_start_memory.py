"""Starting an 8-process (dp, tp, pp) = (2, 2, 2) job on a Hugging Face Llama of >= 200 MB: what each
rank holds and reads, threefold (meta build + sliced safetensors reads) beside the PyTorch-native way
(every rank calls `from_pretrained` and would then drop what it does not hold).

    PYTHONPATH=src python bench/hf_start_memory.py [--hidden 768 --layers 6 --vocab 32000]

Per rank: `held` = bytes of the model tensors it holds after parallelize(); `alloc` = every byte of
model tensors parallelize() allocated while starting (materialise's running total, freed or not:
an upper bound of the peak model-tensor bytes the rank ever held); `read` = bytes of the
boxes it asked the safetensors files for; `rss+` = growth of the process's peak resident memory
(VmHWM after resetting it: every byte it touched, transient buffers and mapped file pages
included - a slice along the inner dimension touches every page of the tensor's file range)
while starting. `from_pretrained` memory-maps the file and touches pages only when they are
used, so its `rss+` stays small although it holds the whole model. The bound of the issue: 1/4 of the model + the largest single tensor.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

import torch


def _reset_peak() -> int:
    """Reset this process's peak resident size (Linux: clear_refs 5) and return the current one."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    """Growth of the peak resident size since `_reset_peak`."""
    return _status("VmHWM")


def threefold_start(directory: str, layout: tuple[int, int, int]) -> dict:
    from threefold.checkpoint.hf import pretrained
    from threefold.comm import Comm
    from threefold.config import load_config
    from threefold.mesh import Layout, Mesh
    from threefold.models.registry import model_spec
    from threefold.observe.memory import storage_bytes
    from threefold.parallel import parallelize

    dp, tp, pp = layout
    cfg = load_config(None, [f"model.preset=hf:{directory}", f"parallel.dp={dp}", f"parallel.tp={tp}",
                             f"parallel.pp={pp}", "train.seq_len=16", "train.global_batch=8"])
    cfg = cfg.validate(torch.distributed.get_world_size())
    mesh = Mesh(Layout(dp=dp, tp=tp, pp=pp), torch.device("cpu"))
    spec = pretrained(model_spec(cfg.model, 0))
    before = _reset_peak()
    parallel = parallelize(spec, mesh, Comm(mesh), cfg)
    return {"held": storage_bytes(parallel.param_tensors()), "read": spec.weights.bytes_read,
            "alloc": parallel.materialised_bytes, "rss": _rss() - before}


def native_start(directory: str) -> dict:
    import transformers

    before = _reset_peak()
    with contextlib.redirect_stderr(io.StringIO()):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"held": held, "read": held, "rss": _rss() - before}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    import transformers

    from threefold.launch.world import World

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                          intermediate_size=int(args.hidden * 8 / 3) // 64 * 64,
                                          num_attention_heads=args.hidden // 64, num_key_value_heads=4,
                                          max_position_embeddings=256)
        with contextlib.redirect_stderr(io.StringIO()):
            model = transformers.LlamaForCausalLM(config)
            model.save_pretrained(directory)
        sizes = [p.numel() * p.element_size() for p in model.parameters()]
        total, largest = sum(sizes), max(sizes)
        del model
        bound = total / 4 + largest
        print(f"model {total / 1e6:.1f} MB ({len(sizes)} tensors, largest {largest / 1e6:.1f} MB); "
              f"bound 1/4 + largest = {bound / 1e6:.1f} MB")
        with World(8, timeout_s=600) as world:
            ours = world.run(threefold_start, str(directory), (2, 2, 2))
            theirs = world.run(native_start, str(directory))
        print(f"{'rank':>4} {'threefold held':>15} {'alloc':>10} {'read':>10} {'rss+':>10}   "
              f"{'from_pretrained held':>21} {'rss+':>10}")
        for rank, (a, b) in enumerate(zip(ours, theirs)):
            print(f"{rank:>4} {a['held'] / 1e6:>12.1f} MB {a['alloc'] / 1e6:>7.1f} MB {a['read'] / 1e6:>7.1f} MB "
                  f"{a['rss'] / 1e6:>7.1f} MB   {b['held'] / 1e6:>18.1f} MB {b['rss'] / 1e6:>7.1f} MB")
        print("as fractions of the model, worst rank: threefold held "
              f"{max(a['held'] for a in ours) / total:.3f}, alloc {max(a['alloc'] for a in ours) / total:.3f}, "
              f"read {max(a['read'] for a in ours) / total:.3f}, rss+ {max(a['rss'] for a in ours) / total:.3f}; "
              f"from_pretrained held {max(b['held'] for b in theirs) / total:.3f}, "
              f"rss+ {max(b['rss'] for b in theirs) / total:.3f}")
        worst = max(max(a["held"], a["read"], a["alloc"]) for a in ours)
        print(f"worst rank: threefold holds/reads {worst / 1e6:.1f} MB = {worst / total:.3f} of the model "
              f"(bound {bound / total:.3f}); from_pretrained holds {max(b['held'] for b in theirs) / total:.3f} "
              f"(ratio {max(b['held'] for b in theirs) / worst:.1f}x)")
        print(f"peak RSS growth while starting: threefold {max(a['rss'] for a in ours) / 1e6:.1f} MB (includes the "
              f"file pages its reads mapped), from_pretrained {max(b['rss'] for b in theirs) / 1e6:.1f} MB "
              "(it maps the file and touches pages lazily)")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
