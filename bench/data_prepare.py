"""`threefold data prepare` throughput against the `tokenizers` library alone on the same files.

Both sides tokenize the same documents with the same tokenizer.json. threefold: `prepare()`
end to end (expand sources, worker processes, shards, index; a fresh --out each round), timed
by the wall clock, per worker = tokens/s / workers. Baseline: one process reading the files and
calling `Tokenizer.encode_batch_fast` - once single-threaded (TOKENIZERS_PARALLELISM=false, the
per-worker comparison) and once with the library's own thread pool (its usual setting). Rounds
alternate; medians are printed with ratios.

    python bench/data_prepare.py [--sources GLOB...] [--vocab 8000] [--workers 1,2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sysconfig
import time
from pathlib import Path

from threefold.data.documents import Skipped, documents, expand
from threefold.data.prepare import PrepareOptions, prepare
from threefold.data.tokenizer import train_bpe


def baseline(tokenizer_json: Path, sources: list[str], threads: bool) -> tuple[int, float]:
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"
    start = time.perf_counter()
    tok = Tokenizer.from_file(str(tokenizer_json))
    texts = [Path(u.path).read_text() for s in sources for u in expand(s)]
    tokens = sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))
    return tokens, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sources", nargs="+", default=[str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")])
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/out/data_prepare")
    args = p.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    skipped = Skipped()
    units = [u for s in args.sources for u in expand(s)]
    train_bpe((b for u in units for b in documents(u, False, skipped)), args.vocab, out / "tok")
    print(f"{len(units)} files, {sum(u.size for u in units) / 1e6:.1f} MB, BPE vocab {args.vocab}; load "
          f"{os.getloadavg()[0]:.1f}")
    workers = [int(w) for w in args.workers.split(",")]
    results: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for w in workers:
            start = time.perf_counter()
            res = prepare(PrepareOptions(args.sources, str(out / "tok"), out / f"data-{r}-{w}", 0.0, w,
                                         progress=False))
            rate = res["index"]["splits"]["train"]["tokens"] / (time.perf_counter() - start)
            results.setdefault(f"prepare, {w} worker(s): tokens/s per worker", []).append(rate / w)
            results.setdefault(f"prepare, {w} worker(s): tokens/s in all", []).append(rate)
        for threads in (False, True):
            tokens, seconds = baseline(out / "tok" / "tokenizer.json", args.sources, threads)
            results.setdefault(f"tokenizers, one process, {'its thread pool' if threads else '1 thread'}: tokens/s",
                               []).append(tokens / seconds)
    print(f"medians of {args.rounds} alternating rounds (load now {os.getloadavg()[0]:.1f}):")
    for name, values in results.items():
        print(f"  {name:62s} {statistics.median(values):12,.0f}")
    single = statistics.median(results["tokenizers, one process, 1 thread: tokens/s"])
    for w in workers:
        per = statistics.median(results[f"prepare, {w} worker(s): tokens/s per worker"])
        print(f"  prepare per worker / tokenizers single-threaded, {w} worker(s): {per / single:.2f}")


if __name__ == "__main__":
    main()
