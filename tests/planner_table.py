"""The planner's validation tables of docs/planner.md, printed from the data of
tests/unit/test_planner_validation.py and tests/unit/test_planner_published.py: every figure of a row (its
prediction, error, verdict and measured / predicted peak memory) and the counts come from the predictions, so no
number in those tables is written by hand. docs/planner.md holds them between the BEGIN and END markers below;
`test_the_docs_tables_are_printed_from_the_data` holds the two equal, and

    PYTHONPATH=src:. python -m tests.unit.test_planner_validation --markdown --write-docs

rewrites the block after a change to the planner (`--markdown` alone prints it)."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "planner.md"
BEGIN = "<!-- validation tables: printed by `python -m tests.unit.test_planner_validation --markdown` -->"
END = "<!-- end of the validation tables -->"


def _value(metric: str, value: float, exact: bool = False) -> str:
    if metric == "mfu":
        return f"{value:.1%}"
    if metric == "seconds":
        return f"{value} s" if exact else f"{value:.3g} s"
    if metric == "tokens_per_gpu":
        return f"{value:,}" if exact else f"{float(f'{value:.3g}'):,.0f}"
    return f"{value}" if exact else f"{value:.4g}"


def _error_cell(v, run, err: float) -> str:
    name, known_miss = run[0], run[9]
    cell = f"{err:+.1%}".replace("-", "−")
    if name in v.REPEATS_CALIBRATION:
        return cell + " (repeats a calibration layout: not counted)"
    why = v.verdict(err, known_miss)
    return cell + (" (miss)" if known_miss is not None else "") + (f" **{why}**" if why else "")


def _memory_cell(p, name: str, best) -> str:
    from threefold.planner.hardware import GiB

    if name not in p.MEASURED_PEAK_GIB:
        return ""
    measured, predicted = p.MEASURED_PEAK_GIB[name], best.memory.total / GiB
    cell = f"{measured:.1f} / {predicted:.1f}"
    if name in p.COMPILED_SELECTIVE:
        return cell + " (compile: not scored)"
    err = f"{predicted / measured - 1:+.1%}".replace("-", "−")
    return cell + (f" ({err}, miss)" if name in p.MEMORY_MISSES else f" ({err})")


def render() -> str:
    """The block of docs/planner.md: the first validation set's table, the added rows' table, the counts."""
    from tests.unit import test_planner_published as p
    from tests.unit import test_planner_validation as v

    added = {run[0] for run in p.NEW_RUNS}
    first = ["| run | source | layout (planner's completion) | published | predicted | error |",
             "| --- | --- | --- | --- | --- | --- |"]
    second = ["| run | layout | published tokens/s/GPU | predicted | error | peak GiB measured / predicted |",
              "| --- | --- | --- | --- | --- | --- |"]
    within = {True: [0, 0], False: [0, 0]}  # added? -> [within, scored]
    for run in v.RUNS:
        name, metric, published = run[0], run[7], run[8]
        value, best = v.predict(run)
        if best is None:
            raise AssertionError(f"{name}: the published layout is predicted not to fit")
        err = v.error(run, value)
        cells = [best.strategy.label(), _value(metric, published, exact=True), _value(metric, value),
                 _error_cell(v, run, err)]
        if name in added:
            second.append("| " + " | ".join([name, *cells, _memory_cell(p, name, best)]) + " |")
        else:
            first.append("| " + " | ".join([name, v.source(name), *cells]) + " |")
        if name not in v.REPEATS_CALIBRATION:
            count = within[name in added]
            count[0] += abs(err) <= v.WITHIN
            count[1] += 1
    (a, n), (b, m) = within[False], within[True]
    counts = (f"Within {v.WITHIN:.0%}: {a} of the {n} rows of the first table, {b} of the {m} added rows, "
              f"**{a + b} of the {n + m} validation rows**.")
    return "\n".join([BEGIN, "", *first, "", *second, "", counts, "", END])


def docs_block(text: str | None = None) -> str:
    """The block as docs/planner.md holds it (markers included)."""
    text = DOC.read_text() if text is None else text
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def write_docs() -> None:
    text = DOC.read_text()
    DOC.write_text(text.replace(docs_block(text), render()))


def main(argv: list[str] | None = None) -> None:
    """python -m tests.unit.test_planner_validation [--gpu KIND.toml] [--no-best] [--markdown [--write-docs]] [ROW...]:
    the rows as a table with the planner's best layout of each (or docs/planner.md's block)."""
    import argparse

    from tests.unit.test_planner_validation import (LLAMA3_ROWS, REPEATS_CALIBRATION, RUNS, WITHIN, error,
                                                    executed_tflops, predict, software_best)

    from threefold.planner.hardware import load_gpu

    parser = argparse.ArgumentParser(description=main.__doc__, prog="python -m tests.unit.test_planner_validation")
    parser.add_argument("rows", nargs="*", help="only the rows whose names start so")
    parser.add_argument("--gpu", help="a GPU kind file (bench/planner_kernels.py --toml) for the rows on the preset "
                                      "its name starts with")
    parser.add_argument("--no-best", action="store_true", help="skip the last column (the software's best layout: "
                                                               "a search of every layout, minutes)")
    parser.add_argument("--markdown", action="store_true", help="docs/planner.md's validation tables (tests/planner_table.py)")
    parser.add_argument("--write-docs", action="store_true", help="with --markdown: write them into docs/planner.md")
    args = parser.parse_args(argv)
    if args.markdown:
        return write_docs() if args.write_docs else print(render())
    measured = load_gpu(args.gpu) if args.gpu else None
    within = scored = 0
    for run in RUNS:
        name, m, gpu, gpus, batch, seq, knobs, metric, published, _ = run
        if args.rows and not any(name.startswith(o) for o in args.rows):
            continue
        if measured is not None and measured.name.startswith(gpu.name):
            run = (name, m, measured, *run[3:])
        value, chosen = predict(run)
        if chosen is None:
            print(f"| {name} | nothing fits | {published} | - | - | - |")
            continue
        best = None if args.no_best else software_best(run)  # every layout the run's software offered
        gain = "-" if args.no_best else f"{best.tokens_per_s / chosen.tokens_per_s - 1:+.0%} ({best.strategy.label()})" \
            if best is not None else "nothing fits"
        if name not in REPEATS_CALIBRATION:
            scored, within = scored + 1, within + (abs(error(run, value)) <= WITHIN)
        if name in REPEATS_CALIBRATION:
            name += " (repeats a calibration layout: not in the validation set)"
        executed = f" (executed count {executed_tflops(run) / published - 1:+.1%})" if run in LLAMA3_ROWS else ""
        print(f"| {name} | {chosen.strategy.label()} | {published} | {value:.3g} | {error(run, value):+.1%}{executed} | "
              f"{gain} |", flush=True)
    if not args.rows and measured is None:
        print(f"{within} of {scored} validation rows within {WITHIN:.0%}")
