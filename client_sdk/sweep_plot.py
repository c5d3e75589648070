"""The picture of a sweep (`curves.png`): every trial's training loss per step and its held-out
evaluations, side by side, under one legend.

Readable whatever one trial does:
- A trial far above the rest (a diverged learning rate: held-out loss 36 where the others lie
  between 3.5 and 5.5) would flatten every other curve into a band. Each panel's y axis is
  clipped to the other trials' values instead, the axis label says so and names the trials cut
  off with the highest value each reached, and a marker on the top edge stands at the step of
  that value.
  Values spanning orders of magnitude (all positive) are shown on a log scale.
- Pruned trials are dashed, drawn over the completed ones, and end in a distinct marker (an X)
  where they were stopped, so they do not hide under the others' lines.

Plain data in (anything with a trial's `number`, `state`, `curve` and `evals`); matplotlib's Agg
backend out, so it needs no display.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# A trial is cut off a panel when its highest value stands this many times further above the
# panel's lowest value than the trials' typical highest value does.
OUTLIER_SPAN = 3.0
# Kept values spanning more than this ratio (all positive) are drawn on a log scale.
LOG_RATIO = 20.0
PRUNED_MARKER = "X"


class Trial(Protocol):
    number: int
    state: str
    curve: list[float]
    evals: list[tuple[int, float]]


@dataclass(frozen=True)
class Axis:
    """A panel's y axis: its limits (None: matplotlib's own), whether it is logarithmic, and
    the trials cut off above the top, each with the highest value it reached."""

    limits: tuple[float, float] | None
    log: bool
    above: dict[int, float]


def y_axis(series: dict[int, Sequence[float]]) -> Axis:
    """The y axis of a panel showing each trial's values (trial number -> values)."""
    finite = {n: [v for v in vs if math.isfinite(v)] for n, vs in series.items()}
    finite = {n: vs for n, vs in finite.items() if vs}
    if not finite:
        return Axis(None, False, {})
    low = min(min(vs) for vs in finite.values())
    highs = {n: max(vs) for n, vs in finite.items()}
    typical = statistics.median(highs.values())
    span = typical - low
    above = {n: h for n, h in highs.items() if span > 0 and h - low > OUTLIER_SPAN * span}
    kept = [v for n, vs in finite.items() if n not in above for v in vs]
    top = max(kept)
    log = low > 0 and top / low > LOG_RATIO
    if not above:
        return Axis(None, log, {})
    if log:
        return Axis((low / 1.2, top * 1.2), True, above)
    pad = 0.05 * (top - low) or 0.05 * abs(top) or 1.0
    return Axis((low - pad, top + pad), False, above)


def _apply(ax: Any, axis: Axis, label: str, points: dict[int, tuple[float, str]]) -> None:
    """Set the panel's scale, limits and label; mark where each cut-off trial leaves the top
    (`points`: trial -> (the step of its highest value, its colour))."""
    if axis.log:
        ax.set_yscale("log")
    if axis.limits is not None:
        ax.set_ylim(*axis.limits)
    if axis.above:
        cut = ", ".join(f"#{n} reaches {v:.3g}" for n, v in sorted(axis.above.items()))
        label = f"{label} (axis clipped: {cut})"
        top = ax.get_ylim()[1]
        for n in axis.above:
            step, colour = points[n]
            ax.plot([step], [top], "^", color=colour, markersize=9, clip_on=False, zorder=5)
    ax.set_ylabel(label, fontsize="small" if axis.above else None)


def figure(name: str, objective: str, trials: Sequence[Trial]) -> Any:
    """The sweep's figure (a matplotlib Figure; the caller saves or closes it)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server, and no GUI toolkit needed
    from matplotlib import pyplot as plt
    from matplotlib.lines import Line2D

    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    train_top: dict[int, tuple[float, str]] = {}
    eval_top: dict[int, tuple[float, str]] = {}
    handles, labels = [], []
    # Completed trials first, pruned ones over them: a stopped curve stays visible.
    for t in sorted(trials, key=lambda t: (t.state == "PRUNED", t.number)):
        if not t.curve:
            continue
        pruned = t.state == "PRUNED"
        style = "-" if t.state == "COMPLETE" else "--"
        z = 3 if pruned else 2
        steps = range(1, len(t.curve) + 1)
        (line,) = ax_train.plot(steps, t.curve, style, zorder=z)
        colour = line.get_color()
        handles.append(line)
        labels.append(f"#{t.number} {t.state.lower()}")
        train_top[t.number] = (_arg_max(list(steps), t.curve), colour)
        if pruned:
            ax_train.plot([len(t.curve)], [t.curve[-1]], PRUNED_MARKER, color=colour,
                          markersize=10, markeredgecolor="black", zorder=4)  # fmt: skip
        if t.evals:
            xs, ys = zip(*t.evals, strict=True)
            ax_eval.plot(xs, ys, style, marker="o", color=colour, zorder=z)
            eval_top[t.number] = (_arg_max(list(xs), list(ys)), colour)
            if pruned:
                ax_eval.plot([xs[-1]], [ys[-1]], PRUNED_MARKER, color=colour, markersize=11,
                             markeredgecolor="black", zorder=4)  # fmt: skip
    ax_train.set(title="training loss", xlabel="step")
    ax_eval.set(title=f"held-out {objective}", xlabel="step")
    _apply(ax_train, y_axis({t.number: t.curve for t in trials}), "loss", train_top)
    series = {t.number: [v for _, v in t.evals] for t in trials if t.evals}
    _apply(ax_eval, y_axis(series), objective, eval_top)
    if any(t.state == "PRUNED" and t.curve for t in trials):
        handles.append(
            Line2D([], [], linestyle="", marker=PRUNED_MARKER, color="grey",
                   markeredgecolor="black", markersize=9)
        )  # fmt: skip
        labels.append("pruned here")
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    fig.suptitle(f"sweep {name}")
    return fig


def plot(name: str, objective: str, trials: Sequence[Trial], path: Path) -> None:
    """The sweep's figure, saved as a PNG to `path`."""
    fig = figure(name, objective, trials)
    from matplotlib import pyplot as plt

    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def _arg_max(xs: list[int], ys: Sequence[float]) -> float:
    """The x of the highest finite y (the last x when none is finite)."""
    finite = [i for i, y in enumerate(ys) if math.isfinite(y)]
    return xs[max(finite, key=lambda i: ys[i])] if finite else xs[-1]
