"""Pictures of a pipeline timeline: a rank x time chart (PNG/SVG) and a Chrome trace (JSON).

The chart is the one of the GPipe / Megatron-LM / zero-bubble papers: one row per pp rank,
a box per compute action labelled with its micro-batch, coloured by kind (forward,
backward, backward-input, backward-weight), the gaps being the bubble. With virtual stages,
later model chunks are drawn lighter (the V schedules' second chunk too), and the
overlapped forward + backward pairs of dualpipev hatched. The same function draws a simulated schedule and a
measured run. The trace opens in chrome://tracing or ui.perfetto.dev (one track per rank).
"""

from __future__ import annotations

import json
from pathlib import Path

from .timeline import COMPUTE_KINDS, Event, bubble_fractions

COLORS = {"F": "#4C72B0", "B": "#C44E52", "I": "#DD8452", "W": "#55A868"}
LABELS = {"F": "forward", "B": "backward", "I": "backward-input", "W": "backward-weight"}


def _lighten(hex_color: str, amount: float) -> tuple[float, float, float]:
    rgb = [int(hex_color[i: i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * amount for c in rgb)


def draw_timeline(events: list[Event], pp: int, out: str | Path, title: str = "", unit: str = "time",
                  paired: set | None = None) -> Path:
    """Draw the compute events of `events` as a rank x time chart; the format follows out's suffix.
    `paired`: (rank, Action) of the overlapped forward + backward pairs (dualpipev), drawn hatched."""
    import matplotlib.pyplot as plt

    out = Path(out)
    fig = timeline_figure(events, pp, title, unit, paired)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def timeline_figure(events: list[Event], pp: int, title: str = "", unit: str = "time", paired: set | None = None):
    """The figure of draw_timeline; its title always fits inside it (the figure widens for a long one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    t0 = min((e.start for e in compute), default=0.0)
    span = max((e.end for e in compute), default=1.0) - t0 or 1.0
    chunks = max((e.stage // pp for e in compute), default=0) + 1
    fig, ax = plt.subplots(figsize=(min(40.0, 3 + 0.25 * len(compute) / max(pp, 1)), 0.6 * pp + 1.4))
    for r in range(pp):
        ax.add_patch(Rectangle((0, r - 0.4), span, 0.8, color="#EEEEEE", zorder=0))
    smallest = min((e.end - e.start for e in compute), default=span)
    for e in compute:
        chunk = e.stage // pp
        color = _lighten(COLORS[e.kind], 0.45 * chunk / max(chunks - 1, 1))
        hatch = "///" if paired and (e.rank, (e.kind, e.stage, e.mb)) in paired else None
        ax.add_patch(Rectangle((e.start - t0, e.rank - 0.4), e.end - e.start, 0.8, facecolor=color,
                               edgecolor="white", linewidth=0.6, zorder=1, hatch=hatch))
        if e.end - e.start >= 0.5 * smallest:
            ax.text((e.start + e.end) / 2 - t0, e.rank, str(e.mb), ha="center", va="center", fontsize=7,
                    color="white", zorder=2)
    ax.set_xlim(0, span)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_xlabel(unit)
    bubbles = bubble_fractions(compute, pp)
    ax.set_title(f"{title}  (bubble {max(bubbles):.1%})" if title else f"bubble {max(bubbles):.1%}")
    kinds = [k for k in COMPUTE_KINDS if any(e.kind == k for e in compute)]
    handles = [Patch(color=COLORS[k], label=LABELS[k]) for k in kinds] + [Patch(color="#EEEEEE", label="idle")]
    if paired:
        handles.append(Patch(facecolor="white", edgecolor="#555555", hatch="///", label="overlapped F + B"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 if pp < 3 else -0.2), ncol=len(handles),
              frameon=False, fontsize=8)
    fig.tight_layout()
    _fit_title(fig, ax)
    return fig


def _fit_title(fig, ax) -> None:
    """Widen the figure until the axes' title lies inside it (a narrow chart cut a long title off)."""
    for _ in range(8):
        fig.canvas.draw()
        box, inside = ax.title.get_window_extent(), fig.bbox
        if box.x0 >= inside.x0 and box.x1 <= inside.x1:
            return
        width, height = fig.get_size_inches()
        fig.set_size_inches(width * box.width / (inside.width * 0.9) + 0.1, height)
        fig.tight_layout()


def chrome_trace(events: list[Event], out: str | Path, seconds_per_unit: float = 1.0) -> Path:
    """Write `events` as Chrome trace-event JSON: one thread per pp rank, compute as complete events,
    transfers as instant events. `seconds_per_unit` converts simulated cost units to time."""
    t0 = min((e.start for e in events), default=0.0)
    us = 1e6 * seconds_per_unit
    trace = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"pp rank {r}"}}
             for r in sorted({e.rank for e in events})]
    for e in events:
        record = {"name": f"{e.kind}{e.mb}", "cat": e.kind, "pid": 0, "tid": e.rank, "ts": (e.start - t0) * us,
                  "args": {"stage": e.stage, "microbatch": e.mb}}
        if e.kind in COMPUTE_KINDS:
            record.update(ph="X", dur=(e.end - e.start) * us)
        else:
            record.update(ph="i", s="t")
        trace.append(record)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return out
