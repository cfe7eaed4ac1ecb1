"""`threefold data ...`: train a BPE tokenizer, prepare token shards (the data package's work, data/).

It sits here, above the config, because `data prepare --config TOML` reads the run's config; data/
itself reads none (the config's checks read the prepared directories). Heavy imports (tokenizers,
pyarrow, datasets) happen inside the commands, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", required=True)
    tok = sub.add_parser("tokenizer", help="tokenizer tools").add_subparsers(dest="tokenizer_command", required=True)
    train = tok.add_parser("train", help="train a byte-level BPE tokenizer on files (writes DIR/tokenizer.json)")
    train.add_argument("sources", nargs="+", metavar="FILE_OR_DIR", help="files, directories, globs or PATH:FIELD")
    train.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, end-of-text token included")
    train.add_argument("--out", required=True, help="directory to write tokenizer.json into (must not hold one)")
    prep = sub.add_parser("prepare", help="tokenize sources into memory-mapped shards with a JSON index")
    prep.add_argument("sources", nargs="+", metavar="SOURCE",
                      help="a file, directory or glob; PATH:FIELD for JSON Lines, Parquet or a datasets directory")
    prep.add_argument("--tokenizer", default="byte", help="directory with tokenizer.json, or 'byte' (the default)")
    prep.add_argument("--out", required=True, help="the data directory to write (or to finish after an interruption)")
    prep.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out for validation")
    prep.add_argument("--workers", type=int, default=0, help="worker processes (default: one per core)")
    prep.add_argument("--shard-mb", type=float, default=16.0, help="text bytes per shard (one task per shard)")
    prep.add_argument("--skip-bad-documents", action="store_true",
                      help="skip documents that are not valid UTF-8 instead of stopping (or data.skip_bad_documents)")
    prep.add_argument("--config", help="TOML file; its data.skip_bad_documents applies")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.data_command == "tokenizer":
        return _train_tokenizer(args)
    return _prepare(args)


def _train_tokenizer(args: argparse.Namespace) -> int:
    from ..data.documents import Skipped, documents, expand
    from ..data.tokenizer import TOKENIZER_FILE, train_bpe

    out = Path(args.out)
    if (out / TOKENIZER_FILE).exists():
        raise UserError(f"--out: '{out / TOKENIZER_FILE}' exists; choose another directory or remove it")
    if args.vocab_size < 2:
        raise UserError(f"--vocab-size: must be at least 2, got {args.vocab_size}")
    units = [u for spec in args.sources for u in expand(spec)]
    skipped = Skipped()
    texts = (batch for unit in units for batch in documents(unit, False, skipped))
    path = train_bpe(texts, args.vocab_size, out)
    print(f"threefold: wrote {path} ({len(units)} files)", file=sys.stderr)
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from ..data.prepare import PrepareOptions, prepare

    if args.workers < 0:
        raise UserError(f"--workers: must be at least 0, got {args.workers}")
    if args.shard_mb <= 0:
        raise UserError(f"--shard-mb: must be positive, got {args.shard_mb}")
    skip = args.skip_bad_documents
    if args.config:
        from ..config import load_config

        skip = skip or load_config(args.config).data.skip_bad_documents
    opts = PrepareOptions(args.sources, args.tokenizer, Path(args.out), args.val_fraction, args.workers,
                          int(args.shard_mb * (1 << 20)), skip, not args.no_progress)
    result = prepare(opts)
    index = result["index"]
    train, val = index["splits"]["train"], index["splits"]["val"]
    if result["already"]:
        print(f"threefold: '{args.out}' is already prepared", file=sys.stderr)
    else:
        rate = result["tokens"] / result["worker_seconds"] if result["worker_seconds"] else 0.0
        print(f"threefold: {result['tokens']} tokens in {result['seconds']:.2f} s with {result['workers']} "
              f"worker(s): {rate:,.0f} tokens/s per worker", file=sys.stderr)
    print(f"threefold: {args.out}: train {train['tokens']} tokens / {train['documents']} documents, "
          f"val {val['tokens']} tokens / {val['documents']} documents, skipped {index['skipped_documents']}"
          f"{', empty files skipped ' + str(index['empty_files']) if index.get('empty_files') else ''}",
          file=sys.stderr)
    return 0
