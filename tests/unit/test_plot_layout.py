"""The run's figures as matplotlib objects: a pipeline chart's title lies inside its figure, and
axes over steps carry whole-number ticks only."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from threefold.observe.plots import expert_load_figure  # noqa: E402
from threefold.pipeline.draw import timeline_figure  # noqa: E402
from threefold.pipeline.timeline import Event  # noqa: E402


def test_a_long_pipeline_title_fits_a_small_chart():
    events = [Event(r, k, r, mb, t + r, t + r + 1) for r in range(2) for mb, (k, t) in enumerate([("F", 0), ("B", 3)])]
    fig = timeline_figure(events, 2, "interleaved-1f1b pp=2 m=2 (measured, step 20)", unit="seconds")
    fig.canvas.draw()
    box, inside = fig.axes[0].title.get_window_extent(), fig.bbox
    assert inside.x0 <= box.x0 and box.x1 <= inside.x1, (box, inside)
    plt.close(fig)


def test_expert_load_ticks_are_whole_steps():
    load = {"min": 1.0, "mean": 2.0, "max": 3.0}
    fig = expert_load_figure([{"step": s, "moe": {"tokens_per_expert": load, "dropped": 0}} for s in (1, 2, 3)])
    fig.canvas.draw()
    for ax in fig.axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert all(label.lstrip("−-").isdigit() for label in labels), labels
    plt.close(fig)
