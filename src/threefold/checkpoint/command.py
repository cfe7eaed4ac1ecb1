"""`threefold ckpt inspect | verify | export`: look at, check and convert checkpoints.

DIR may be a checkpoint (`.../checkpoints/step-00000010`), a `checkpoints/` directory or a run
directory; the latter two mean their newest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..errors import UserError
from .export import export_model
from .format import read_manifest
from .verify import find_checkpoint_dir, verify


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    inspect = sub.add_parser("inspect", help="layout, step, data position, files and tensors of a checkpoint")
    inspect.add_argument("dir", help="checkpoint, checkpoints/ or run directory")
    inspect.add_argument("--json", action="store_true", help="print the manifest (without RNG states) as JSON")
    check = sub.add_parser("verify", help="check that it loads: the manifest and its exact cover, every "
                                          "file's safetensors header against it, sizes and sha256")
    check.add_argument("dir", help="checkpoint, checkpoints/ or run directory")
    export = sub.add_parser("export", help="write the model as one safetensors file, or as a Hugging Face "
                                           "model directory (--hf)")
    export.add_argument("dir", help="checkpoint, checkpoints/ or run directory")
    export.add_argument("out", nargs="?", help="output .safetensors file (start a run from it with "
                                               "checkpoint.init_from)")
    export.add_argument("--hf", metavar="OUT", help="write a Hugging Face model directory (config.json, sharded "
                                                    "safetensors + index, tokenizer files) of a --model hf:DIR run, or "
                                                    "of the reference decoder as a Llama / GPT-2")
    export.add_argument("--dcp", metavar="OUT", help="write a torch.distributed.checkpoint directory: the model under "
                                                     "model.<name>, AdamW's state flattened under optimizer.* "
                                                     "(torchtitan's layout; start a run from it with "
                                                     "checkpoint.init_from or --resume)")
    export.add_argument("--lora", choices=("merged", "adapter"), default="merged",
                        help="a LoRA run's --hf export: the adapters merged into the base (a plain model), or a "
                             "PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    export.add_argument("--shard-mb", type=float, default=2048.0, help="largest safetensors shard of --hf (MB)")
    export.add_argument("--no-check", action="store_true",
                        help="--hf: skip the logit check (transformers' forward of the export against threefold's "
                             "forward of the checkpoint, fp32, 4x16 tokens; it holds the model twice in host memory)")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1000
    return str(n)


def inspect(path: Path, as_json: bool) -> int:
    ckpt = find_checkpoint_dir(path)
    m = read_manifest(ckpt)
    if as_json:
        raw = json.loads(m.to_json())
        raw.pop("rng")
        print(json.dumps(raw, indent=1))
        return 0
    layout = " ".join(f"{k}={v}" for k, v in m.layout.items())
    data = m.data
    print(f"checkpoint  {ckpt}")
    print(f"step        {m.step}")
    print(f"layout      {layout}")
    if data:
        print(f"data        continues at step {m.step + 1} (sample {data.get('samples', '?')}; "
              f"global_batch {data.get('global_batch', '?')}, seq_len {data.get('seq_len', '?')}, "
              f"seed {data.get('seed', '?')})")
    if m.extra:
        print(f"extra       {', '.join(sorted(m.extra))}")
    print(f"files       {len(m.files)}, {_size(m.total_bytes())}")
    for name, f in sorted(m.files.items()):
        print(f"  {name}  rank {f.rank}  {_size(f.bytes)}  sha256 {f.sha256[:16]}...")
    model = [n for n in m.tensors if n.startswith("model/")]
    elements = sum(math.prod(m.tensors[n].shape) for n in model)
    print(f"tensors     {len(m.tensors)} ({len(model)} model, {len(m.tensors) - len(model)} optimizer); "
          f"model parameters {elements:,}")
    width = max((len(n) for n in m.tensors), default=0)
    for name, t in sorted(m.tensors.items()):
        print(f"  {name:<{width}}  {str(list(t.shape)):<14} {t.dtype:<9} {len(t.slices)} slice(s)")
    return 0


def check(path: Path) -> int:
    ckpt = find_checkpoint_dir(path)
    manifest, problems = verify(ckpt)
    if problems:
        for problem in problems:
            print(f"FAILED {problem}", file=sys.stderr)
        return 1
    print(f"OK {ckpt}: step {manifest.step}, {len(manifest.files)} files, {_size(manifest.total_bytes())}, "
          f"{len(manifest.tensors)} tensors complete, headers match the manifest, checksums match, every tensor finite")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "inspect":
        return inspect(Path(args.dir), args.json)
    if args.action == "verify":
        return check(Path(args.dir))
    if sum(x is not None for x in (args.out, args.hf, args.dcp)) != 1:
        raise UserError("ckpt export: give one of an output file (OUT), --hf OUT (a Hugging Face directory) or "
                        "--dcp OUT (a torch.distributed.checkpoint directory)")
    if args.no_check and args.hf is None:
        raise UserError("ckpt export: --no-check skips the logit check of a --hf export; give --hf OUT")
    if args.lora != "merged" and args.hf is None:
        raise UserError("ckpt export: --lora adapter writes a PEFT directory; give it with --hf OUT")
    if args.hf is not None:
        from .hf import export_hf

        ckpt, count = export_hf(Path(args.dir), Path(args.hf), int(args.shard_mb * 2**20), args.lora)
        opener = "peft's PeftModel.from_pretrained" if args.lora == "adapter" else "transformers' from_pretrained"
        print(f"wrote {args.hf}: {count} tensors from {ckpt} (open with {opener})")
        if not args.no_check:
            from .logit_check import check_export

            logits = check_export(ckpt, Path(args.hf))  # a mismatch: CheckpointError (exit 2), the export removed
            print(logits.line() if logits is not None else "export check: skipped (a LoRA checkpoint: threefold's "
                  "forward of it needs its base; docs/lora.md)")
        return 0
    if args.dcp is not None:
        from .dcp import export_dcp

        ckpt, tensors, states = export_dcp(Path(args.dir), Path(args.dcp))
        print(f"wrote {args.dcp}: {tensors} model tensors and {states} optimizer state tensors from {ckpt} (open with "
              "torch.distributed.checkpoint.load, or start a run from it with checkpoint.init_from / --resume)")
        return 0
    ckpt, count = export_model(Path(args.dir), Path(args.out))
    print(f"wrote {args.out}: {count} tensors from {ckpt}")
    return 0
