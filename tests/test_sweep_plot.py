"""The sweep's plot stays readable with an outlier: one diverged trial (held-out loss 36 where the
others lie between 3.5 and 5.5) is clipped off the y axis, which says so, instead of flattening
every other curve; one legend for the figure; pruned trials marked where they stopped, on top."""

from __future__ import annotations

from pathlib import Path

from matplotlib import pyplot as plt

from client_sdk.sweep import TrialRecord
from client_sdk.sweep_plot import PRUNED_MARKER, figure, plot, y_axis

STEPS = 12


def _trial(number: int, start: float, end: float, state: str = "COMPLETE") -> TrialRecord:
    steps = STEPS if state == "COMPLETE" else 6
    curve = [start + (end - start) * i / (STEPS - 1) for i in range(steps)]
    evals = [(s, curve[s - 1] + 0.1) for s in range(3, steps + 1, 3)]
    return TrialRecord(number, {"lr": 0.01}, f"s-t{number}", state, steps, None, curve, evals)


def trials(outlier: bool = True) -> list[TrialRecord]:
    out = [_trial(0, 5.4, 3.5), _trial(1, 5.3, 4.0), _trial(2, 5.2, 4.6)]
    out.append(_trial(3, 5.4, 5.0, "PRUNED"))
    if outlier:  # a learning rate that diverges: 5 up to 36
        out.append(_trial(4, 5.0, 35.9))
    return out


def _data_range(ax) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    ys = [y for line in ax.get_lines() for y in line.get_ydata()]
    return min(ys), max(ys)


def test_an_outlier_trial_is_clipped_off_the_axis_which_says_so(tmp_path: Path) -> None:
    shown = trials()
    fig = figure("s", "loss", shown)
    try:
        ax_train, ax_eval = fig.axes
        rest = [t for t in shown if t.number != 4]
        kept = {
            ax_train: [v for t in rest for v in t.curve],
            ax_eval: [v for t in rest for _, v in t.evals],
        }
        for ax in (ax_train, ax_eval):
            low, high = ax.get_ylim()
            # The other trials (3.5 .. 5.5) fill the axis, with a small margin; 36 is off the top.
            lo, hi = min(kept[ax]), max(kept[ax])
            assert lo - 0.2 < low <= lo and hi <= high < hi + 0.2, (ax.get_title(), low, high)
            assert "axis clipped: #4 reaches 3" in ax.get_ylabel(), ax.get_ylabel()
            assert ax.get_yscale() == "linear"
        # One legend, for the whole figure, naming every trial.
        assert len(fig.legends) == 1
        assert ax_train.get_legend() is None and ax_eval.get_legend() is None
        names = [t.get_text() for t in fig.legends[0].get_texts()]
        assert names[:5] == ["#0 complete", "#1 complete", "#2 complete", "#4 complete",
                             "#3 pruned"] and names[5] == "pruned here"  # fmt: skip
        # The pruned trial ends in its own marker, drawn over every completed line.
        for ax in (ax_train, ax_eval):
            marks = [ln for ln in ax.get_lines() if ln.get_marker() == PRUNED_MARKER]
            assert len(marks) == 1
            others = [ln.get_zorder() for ln in ax.get_lines() if ln.get_linestyle() == "-"]
            assert marks[0].get_zorder() > max(others)
    finally:
        plt.close(fig)
    path = tmp_path / "curves.png"
    plot("s", "loss", trials(), path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_without_an_outlier_every_value_is_on_the_axis() -> None:
    fig = figure("s", "loss", trials(outlier=False))
    try:
        for ax in fig.axes:
            low, high = ax.get_ylim()
            data_low, data_high = _data_range(ax)
            assert low <= data_low and data_high <= high
            assert "clipped" not in ax.get_ylabel()
    finally:
        plt.close(fig)


def test_values_over_orders_of_magnitude_go_on_a_log_scale() -> None:
    axis = y_axis({0: [100.0, 10.0, 1.0, 0.1], 1: [90.0, 5.0, 0.5]})
    assert axis.log and axis.above == {} and axis.limits is None
    # A diverged trial among them is still cut off, on the log axis.
    axis = y_axis({0: [100.0, 1.0, 0.1], 1: [90.0, 0.5], 2: [80.0, 1e6]})
    assert axis.log and axis.above == {2: 1e6} and axis.limits is not None
    assert axis.limits[1] < 200
