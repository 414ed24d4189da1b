"""PNG plots of an experiment (optional extra `plots`, matplotlib): distributions and CDFs, the
ratio or shift of every comparison with its interval, and the cost/latency Pareto front."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from torchhal.evaluation.experiment import ExperimentResult
from torchhal.evaluation.metrics import METRICS
from torchhal.evaluation.stats._checks import constant
from torchhal.hal_core import ConfigurationError


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(result: ExperimentResult, out_dir: str | Path) -> list[Path]:
    """Write the plots into `out_dir`; returns their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    paths = [_distributions(plt, result, metric, out) for metric in result.config.metrics]
    if result.comparisons:
        paths.append(_comparisons(plt, result, out))
    if result.cost:
        paths.append(_pareto(plt, result, out))
    return paths


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigurationError(
            "PNG plots need matplotlib, the optional extra 'plots': pip install 'torchhal[plots]'"
        ) from exc
    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def _distributions(plt: Any, result: ExperimentResult, metric: str, out: Path) -> Path:
    unit = METRICS[metric].unit
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(11, 4))
    for index, name in enumerate(result.variants):
        color = f"C{index}"  # one colour per variant in both panels, whichever way each is drawn
        values = np.sort(result.samples(name, metric))
        if constant(values):  # deterministic: one value, one line
            hist.axvline(values[0], label=f"{name} (every sample)", color=color)
        else:
            hist.hist(values, bins=min(30, max(5, values.size // 3)), alpha=0.5, label=name, color=color)
        cdf.step(
            values,
            np.arange(1, values.size + 1) / values.size,
            where="post",
            label=name,
            color=color,
        )
    hist.set(title=f"{metric}: distribution", xlabel=unit, ylabel="samples")
    cdf.set(title=f"{metric}: empirical CDF", xlabel=unit, ylabel="fraction <= x")
    hist.legend(fontsize="small")
    cdf.legend(fontsize="small")
    return _save(plt, fig, out / f"{metric}_distribution.png")


def _comparisons(plt: Any, result: ExperimentResult, out: Path) -> Path:
    """One panel per metric: the ratio of medians (positive metrics, reference 1) or the
    Hodges–Lehmann shift (others, reference 0) of each variant, its interval, the threshold band."""
    metrics = [m for m in result.config.metrics if any(c.metric == m for c in result.comparisons)]
    fig, axes = plt.subplots(len(metrics), 1, figsize=(8, 1.6 + 0.9 * len(result.comparisons)), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics, strict=True):
        rows = [c for c in result.comparisons if c.metric == metric]
        as_ratio = all(c.ratio is not None and c.ratio_interval is not None for c in rows)
        ref = 1.0 if as_ratio else 0.0
        for y, c in enumerate(rows):
            if as_ratio:
                assert c.ratio is not None and c.ratio_interval is not None
                value, (lo, hi) = c.ratio, c.ratio_interval
                band = c.threshold / abs(c.median_baseline)
            else:
                value, (lo, hi), band = c.shift, c.shift_interval, c.threshold
            ax.errorbar(value, y, xerr=[[value - lo], [hi - value]], fmt="o", capsize=4)
            ax.annotate(
                c.verdict.value, (hi, y), xytext=(6, -3), textcoords="offset points", fontsize="small"
            )
            if np.isfinite(band):  # NaN: a relative threshold of a baseline median of 0 (no threshold)
                ax.axvspan(ref - band, ref + band, alpha=0.1)
        ax.axvline(ref, color="grey", linestyle="--")
        ax.set_yticks(range(len(rows)), [c.variant for c in rows])
        unit = METRICS[metric].unit
        ax.set(
            title=f"{metric}: variant vs {result.config.baseline} ({1 - result.config.alpha:.0%} intervals; "
            "shaded: noise threshold)",
            xlabel="ratio of medians" if as_ratio else f"shift ({unit})",
        )
    return _save(plt, fig, out / "comparisons.png")


def _pareto(plt: Any, result: ExperimentResult, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 5))
    for r in result.cost:
        front = r.variant in result.pareto
        ax.scatter(r.median_latency_ms, r.cost_per_million_items, marker="o" if front else "x", s=60)
        ax.annotate(
            r.variant + (" (simulated)" if r.simulated else ""),
            (r.median_latency_ms, r.cost_per_million_items),
        )
    front_rows = sorted(
        (r for r in result.cost if r.variant in result.pareto), key=lambda r: r.median_latency_ms
    )
    ax.plot([r.median_latency_ms for r in front_rows], [r.cost_per_million_items for r in front_rows], "--")
    ax.set(
        title="cost vs latency (o: Pareto front)", xlabel="median latency (ms)", ylabel="cost per 10⁶ items"
    )
    return _save(plt, fig, out / "pareto.png")


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
