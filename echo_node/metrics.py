"""Run metrics: one JSON object per line in `metrics.jsonl`, a summary, and PNG plots.

`summarize_run` and `plot_run` read only `train` records and skip any key a record lacks, so a
file written before a key existed still summarizes and plots.

Lines are flushed as they are written so that `echo-node demo` (and a researcher's `tail -f`)
can follow a live run; a reader must tolerate a partial last line.
"""

from __future__ import annotations

import json
import math
import numbers
from functools import partial
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from matplotlib.axes import Axes


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh: TextIO = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a partially written last line
    return out


def first_last_update_rewards(records: Iterable[dict[str, Any]]) -> tuple[float | None, float | None]:
    """The mean reward of the run's first and last updates: the `train` records of the lowest and
    the highest version (each record's `reward_mean` is over the groups that update trained).

    None for both when no update was recorded, never NaN (summary.json must stay strict JSON). A
    version recorded twice (a step redone from the journal after a crash) counts once, as its
    latest record says; records without a finite reward are skipped.
    """
    by_version: dict[int, float] = {}
    for r in records:
        version, reward = r.get("version"), _num(r, "reward_mean")
        if r.get("event") == "train" and isinstance(version, int) and not isinstance(version, bool) and reward is not None:
            by_version[version] = reward
    if not by_version:
        return None, None
    return by_version[min(by_version)], by_version[max(by_version)]


def json_safe(obj: Any, *, reasons: dict[str, str] | None = None, _path: str = "") -> Any:
    """`obj` with every non-finite float (NaN, inf, -inf) replaced by None, through dicts, lists
    and tuples (a tuple comes back a list, as JSON writes it); anything else is returned as is.

    Rule: what is written as JSON is strict JSON (RFC 8259 has no NaN or Infinity, and `json`
    writes them unless told not to), so a value that is not a number is `null`, never the string
    "NaN". `reasons`, when given, collects what was replaced: "a.b[2]" -> "NaN" | "inf" | "-inf",
    so that the writer can say why a field is null."""
    # numbers.Real less Integral: float, and numpy's floating types (they register as Real).
    if isinstance(obj, numbers.Real) and not isinstance(obj, numbers.Integral) and not math.isfinite(value := float(obj)):
        if reasons is not None:
            reasons[_path or "."] = "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v, reasons=reasons, _path=f"{_path}.{k}" if _path else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v, reasons=reasons, _path=f"{_path}[{i}]") for i, v in enumerate(obj)]
    return obj


def rounded(value: float | None, digits: int = 4) -> float | None:
    """`round`, for a summary field that is null when there is nothing to say (no update)."""
    return None if value is None else round(value, digits)


def _train_steps(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == "train"]


def _num(record: dict[str, Any], key: str) -> float | None:
    """`record[key]` as a finite float, or None when absent, non-numeric or not finite.

    json.dumps writes NaN/inf as bare tokens and json.loads reads them back, so one diverged update
    (a NaN loss or log-prob) would otherwise poison a run-wide sum or a plot's axis limits.
    """
    v = record.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _update_idle(record: dict[str, Any]) -> float | None:
    """wait_s / (wait_s + train_s) of one update; None when either is missing or both are 0."""
    wait, train = _num(record, "wait_s"), _num(record, "train_s")
    if wait is None or train is None or wait + train <= 0:
        return None
    return wait / (wait + train)


def _staleness_hist(record: dict[str, Any]) -> dict[int, float]:
    raw = record.get("staleness_hist")
    out: dict[int, float] = {}
    if not isinstance(raw, dict):
        return out
    for k in raw:
        try:
            age = int(k)
        except (TypeError, ValueError):
            continue
        n = _num(raw, k)
        if n is not None and age >= 0:
            out[age] = out.get(age, 0.0) + n
    return out


def _token_weighted(steps: Sequence[dict[str, Any]], key: str) -> float | None:
    """Mean of a per-update token mean over the run, each update weighted by its `tokens`.

    An update's `key` is already a mean over its tokens, so weighting by tokens gives the mean
    over every token of the run. Updates without `tokens` (the learner omits it when it skips an
    update) carry no weight.
    """
    num = den = 0.0
    for r in steps:
        v, w = _num(r, key), _num(r, "tokens")
        if v is not None and w is not None and w > 0:
            num += v * w
            den += w
    return num / den if den > 0 else None


def _summed_staleness_hist(steps: Sequence[dict[str, Any]]) -> dict[int, float]:
    hist: dict[int, float] = {}
    for r in steps:
        for k, n in _staleness_hist(r).items():
            hist[k] = hist.get(k, 0.0) + n
    return dict(sorted(hist.items()))


def summarize_run(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The aggregates behind `plot_run`, from `train` records only (other events are ignored).

    Keys (a key absent from every record gives an empty dict, 0, or None, never an error):
    - `updates`: number of train records;
    - `tokens_total`: sum of `tokens`;
    - `staleness_hist`: {k: trained tokens k versions behind}, summed over the run, sorted by k;
    - `staleness_token_mean`: mean k over those tokens, or None;
    - `spanning`: sum of `spanning`, the rollouts trained whose tokens carry several versions;
    - `idle_ratio_update_mean`: mean over updates of wait_s / (wait_s + train_s), or None;
    - `idle_ratio_final`: the last cumulative `idle_ratio`, or None;
    - `dropped`: the last cumulative `dropped` dict (reason -> rollouts), sorted by reason;
    - `is_weight_mean`, `is_truncated_frac`: over the run's tokens (see `_token_weighted`), or None;
    - `is_weight_min`, `is_weight_max`: extremes over the run, or None.
    """
    steps = _train_steps(records)
    hist = _summed_staleness_hist(steps)
    hist_tokens = sum(hist.values())
    idles = [x for x in map(_update_idle, steps) if x is not None]
    cumulative_idle = [x for x in (_num(r, "idle_ratio") for r in steps) if x is not None]
    drops = [r["dropped"] for r in steps if isinstance(r.get("dropped"), dict)]
    mins = [x for x in (_num(r, "is_weight_min") for r in steps) if x is not None]
    maxs = [x for x in (_num(r, "is_weight_max") for r in steps) if x is not None]
    return {
        "updates": len(steps),
        "tokens_total": sum(x for x in (_num(r, "tokens") for r in steps) if x is not None),
        "staleness_hist": hist,
        "staleness_token_mean": sum(k * n for k, n in hist.items()) / hist_tokens if hist_tokens > 0 else None,
        "spanning": sum(x for x in (_num(r, "spanning") for r in steps) if x is not None),
        "idle_ratio_update_mean": sum(idles) / len(idles) if idles else None,
        "idle_ratio_final": cumulative_idle[-1] if cumulative_idle else None,
        "dropped": dict(sorted(drops[-1].items())) if drops else {},
        "is_weight_mean": _token_weighted(steps, "is_weight_mean"),
        "is_truncated_frac": _token_weighted(steps, "is_truncated_frac"),
        "is_weight_min": min(mins) if mins else None,
        "is_weight_max": max(maxs) if maxs else None,
    }


_DARK, _LIGHT, _ACCENT = "#1f4e79", "#9bb7d4", "#c55a11"


def _moving_mean(ys: Sequence[float]) -> tuple[list[float], int]:
    """Trailing mean over a tenth of the series, so a curve's trend reads at any run length."""
    window = max(1, len(ys) // 10)
    out = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
    return out, window


def plot_rewards(records: Sequence[dict[str, Any]], path: Path, *, title: str) -> None:
    """Mean sampled reward per update (and its moving mean) and the held-out greedy accuracy
    (`eval` records), against policy version; "no data yet" when the records hold neither."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = _series(_train_steps(records), "version", "reward_mean")
    ex, ey = _series([r for r in records if r.get("event") == "eval"], "version", "eval_accuracy")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    try:
        if xs:
            ax.plot(xs, ys, color=_LIGHT, linewidth=1, label="per update")
            smooth, window = _moving_mean(ys)
            ax.plot(xs, smooth, color=_DARK, linewidth=2, label=f"moving mean ({window})")
        if ex:
            ax.plot(ex, ey, color=_ACCENT, linewidth=1.5, marker="o", markersize=3, label="held-out greedy accuracy")
        if xs or ex:
            ax.set_xlabel("policy version")
            ax.set_ylabel("reward of trained rollouts / accuracy")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right", fontsize="small")
        else:
            _no_data(ax)
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def _no_data(ax: Axes) -> None:
    """An empty figure says so instead of drawing axes with nothing on them."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, "no data yet", transform=ax.transAxes, ha="center", va="center", color="gray", fontsize="large")


def _series(steps: Sequence[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    """(x, y) pairs of the records that carry both keys as finite numbers."""
    pairs = [(_num(r, x), _num(r, y)) for r in steps]
    kept = [(a, b) for a, b in pairs if a is not None and b is not None]
    return [a for a, _ in kept], [b for _, b in kept]


# Per-update series carry "." markers: a line through a single point draws nothing.


def _clock(steps: Sequence[dict[str, Any]], value: Callable[[dict[str, Any]], float | None]) -> tuple[list[Any], list[float]]:
    """(wall-clock datetimes, values) of the records with both a `wall` time and a value: time
    is drawn as the clock people read (local time), which also keeps a resumed run's starts in
    order (`t` starts over at every start of the learner)."""
    from datetime import datetime

    pairs = [(w, v) for w, v in ((_num(r, "wall"), value(r)) for r in steps) if w is not None and v is not None]
    return [datetime.fromtimestamp(w) for w, _ in pairs], [v for _, v in pairs]


def _clock_axis(ax: Axes, times: Sequence[Any]) -> None:
    """A clock on the x axis; a span under a few seconds (one update, a test) is widened to
    them, where the date locator has ticks to offer."""
    from datetime import timedelta

    import matplotlib.dates as mdates

    if times and max(times) - min(times) < timedelta(seconds=4):
        ax.set_xlim(min(times) - timedelta(seconds=2), max(times) + timedelta(seconds=2))
    locator = mdates.AutoDateLocator(maxticks=8)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax.set_xlabel("wall clock (local time)")


def _draw_idle(ax: Axes, steps: Sequence[dict[str, Any]]) -> bool:
    xs, per_update = _clock(steps, _update_idle)
    ts, cum = _clock(steps, lambda r: _num(r, "idle_ratio"))
    if xs:
        ax.plot(xs, per_update, color=_LIGHT, linewidth=1, marker=".", label="per update: wait / (wait + train)")
    if ts:
        ax.plot(ts, cum, color=_DARK, linewidth=2, label="cumulative idle_ratio")
    if xs or ts:
        ax.legend(loc="best", fontsize="small")
        _clock_axis(ax, [*xs, *ts])
    ax.set_ylabel("learner idle share")
    ax.set_ylim(-0.02, 1.02)
    return bool(xs or ts)


def _draw_staleness(ax: Axes, steps: Sequence[dict[str, Any]]) -> bool:
    from matplotlib.ticker import MaxNLocator

    hist = _summed_staleness_hist(steps)
    if hist:
        ax.bar(list(hist), list(hist.values()), color=_DARK, width=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("staleness k (versions behind the version trained on)")
    ax.set_ylabel("trained tokens, summed over the run")
    return bool(hist)


def _draw_tokens(ax: Axes, steps: Sequence[dict[str, Any]]) -> bool:
    xs, ys = _series(steps, "version", "tokens")
    if xs:
        smooth, window = _moving_mean(ys)
        ax.plot(xs, ys, color=_LIGHT, linewidth=1, marker=".", label="per update")
        ax.plot(xs, smooth, color=_DARK, linewidth=2, label=f"moving mean ({window})")
        ax.legend(loc="best", fontsize="small")
    ax.set_xlabel("policy version")
    ax.set_ylabel("tokens trained in the update")
    return bool(xs)


def _draw_is_weights(ax: Axes, steps: Sequence[dict[str, Any]]) -> bool:
    lines = (
        ("is_weight_max", "max", _LIGHT, 1.0, "--"),
        ("is_weight_mean", "mean", _DARK, 2.0, "-"),
        ("is_weight_min", "min", _LIGHT, 1.0, ":"),
    )
    drawn: list[float] = []
    for key, label, color, width, style in lines:
        xs, ys = _series(steps, "version", key)
        if xs:
            ax.plot(xs, ys, color=color, linewidth=width, linestyle=style, marker=".", label=f"weight {label} (before cap)")
            drawn.extend(ys)
    # A weight is a probability ratio: 2 and 0.5 are equally far off-policy, which a log axis shows.
    if drawn and min(drawn) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("policy version")
    ax.set_ylabel("importance weight pi_learner / pi_behaviour")
    xs, ys = _series(steps, "version", "is_truncated_frac")
    if xs:
        right = ax.twinx()
        right.plot(xs, ys, color=_ACCENT, linewidth=1, marker=".", label="truncated share (right)")
        right.set_ylim(-0.02, 1.02)
        right.set_ylabel("share of tokens truncated at the cap", color=_ACCENT)
        handles, labels = ax.get_legend_handles_labels()
        more_h, more_l = right.get_legend_handles_labels()
        # One legend for both axes; a second one would draw over the first.
        right.legend(handles + more_h, labels + more_l, loc="best", fontsize="small")
    elif drawn:
        ax.legend(loc="best", fontsize="small")
    return bool(drawn or xs)


def _dropped(reason: str, record: dict[str, Any]) -> float:
    return _num(record["dropped"], reason) or 0.0


def _draw_drops(ax: Axes, steps: Sequence[dict[str, Any]]) -> bool:
    rows = [r for r in steps if isinstance(r.get("dropped"), dict)]
    reasons = sorted({k for r in rows for k in r["dropped"]})
    xs: list[Any] = []
    for reason in reasons:
        # The dict is cumulative and a reason first appears with its first drop: absent means 0.
        xs, counts = _clock(rows, partial(_dropped, reason))
        ax.plot(xs, counts, linewidth=1.5, marker=".", label=reason)
    if reasons:
        ax.legend(loc="upper left", fontsize="small")
        _clock_axis(ax, xs)
    ax.set_ylabel("rollouts dropped (cumulative)")
    return bool(reasons)


def _draw_verification(ax: Axes, steps: Sequence[dict[str, Any]]) -> bool:
    rows = [(v, r["verify"]) for r in steps if (v := _num(r, "version")) is not None and isinstance(r.get("verify"), dict)]
    if not rows:
        return False
    xs = [v for v, _ in rows]
    checks = sorted({c for _, d in rows for c in d.get("failed", {})})
    for check in checks:  # cumulative failed batches per check; absent means 0
        ax.plot(xs, [_num(d.get("failed", {}), check) or 0.0 for _, d in rows], linewidth=1.5, marker=".", label=f"failed: {check}")
    bans = [_num(d, "banned") or 0.0 for _, d in rows]
    ax.set_xlabel("policy version")
    if checks or any(bans):
        ax.plot(xs, bans, linewidth=1.5, linestyle="--", color="black", label="peers banned")
        ax.set_ylabel("batches failed / peers banned (cumulative)")
    else:  # an axis of zeros would be scaled to noise (-0.04 ... 0.04): say it instead
        ax.set_yticks([])
        ax.text(0.02, 0.5, "no batch failed a check,\nno peer banned", transform=ax.transAxes, va="center", color="gray")
    right = ax.twinx()
    right.plot(xs, [_num(d, "spot_rate") or 0.0 for _, d in rows], color="tab:gray", linewidth=1, label="spot-check rate")
    right.plot(xs, [_num(d, "share") or 0.0 for _, d in rows], color="tab:purple", linewidth=1, label="verify time / train time")
    right.set_ylabel("share")
    handles, labels = ax.get_legend_handles_labels()
    more_h, more_l = right.get_legend_handles_labels()
    ax.legend(handles + more_h, labels + more_l, loc="upper left", fontsize="small")
    return True


_RUN_FIGURES: tuple[tuple[str, str, Callable[[Axes, Sequence[dict[str, Any]]], bool]], ...] = (
    ("idle.png", "learner idle", _draw_idle),
    ("staleness.png", "staleness of trained tokens", _draw_staleness),
    ("tokens.png", "tokens per update", _draw_tokens),
    ("is_weights.png", "importance weights", _draw_is_weights),
    ("drops.png", "drops by reason", _draw_drops),
    ("verification.png", "verification", _draw_verification),
)


def plot_run(records: Sequence[dict[str, Any]], run_dir: Path, *, title: str) -> list[Path]:
    """Write the run's diagnostic PNGs into `run_dir` (next to reward.png); return their paths.

    Files, always all six so a researcher finds the same set after every run:
    - `idle.png`: learner idle share per update (wait_s / (wait_s + train_s)) and the cumulative
      `idle_ratio`, against the wall clock;
    - `staleness.png`: trained tokens per staleness k, summed over the run;
    - `tokens.png`: tokens trained per update, against policy version;
    - `is_weights.png`: importance-weight mean/min/max before the cap (log axis) and the
      truncated share (right axis), against policy version;
    - `drops.png`: cumulative dropped rollouts, one line per reason, against the wall clock;
    - `verification.png`: batches failed per check and peers banned (cumulative), the spot-check
      rate achieved and verification time over training time (right axis), against version.
    A figure with nothing to draw (no update yet, or an older metrics.jsonl without its keys)
    says "no data yet" instead of drawing empty axes.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _train_steps(records)
    run_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, what, draw in _RUN_FIGURES:
        fig = run_figure(draw, steps, title=f"{title}: {what}")
        try:
            path = run_dir / name
            fig.savefig(path)
            written.append(path)
        finally:
            plt.close(fig)
    return written


def run_figure(draw: Callable[[Axes, Sequence[dict[str, Any]]], bool], steps: Sequence[dict[str, Any]], *, title: str) -> Any:
    """One of plot_run's figures, open (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if draw(ax, steps):
        ax.grid(alpha=0.3)
        ax.set_axisbelow(True)  # the grid behind the staleness bars, not across them
    else:
        ax.clear()
        _no_data(ax)
    ax.set_title(title)
    fig.tight_layout()
    return fig
