"""Reports of an experiment: JSON (raw samples and summary) and Markdown (for people and CI logs).

The JSON holds everything needed to redo the analysis: every raw sample with its round and
session, the order samples were taken in, outlier flags, the environment fingerprint, the
configuration, every comparison with its statistics, and the cost rows. Quantiles come with
distribution-free intervals where the sample is large enough for one (and say what it needs
where it is not).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from torchhal.evaluation.experiment import ExperimentResult
from torchhal.evaluation.metrics import METRICS
from torchhal.evaluation.stats import quantile_ci
from torchhal.evaluation.stats.intervals import minimum_size_for_quantile_ci

SCHEMA = "torchhal.evaluation.ab/1"
QUANTILES = (0.5, 0.9, 0.99)


def to_json(result: ExperimentResult) -> dict[str, Any]:
    """The whole result as JSON-able data."""
    m = result.measurement
    variants: dict[str, Any] = {}
    for name, info in result.variants.items():
        entry: dict[str, Any] = {**info, "samples": {}, "summary": {}}
        if m is not None:
            v = m.variants[name]
            entry["timer"] = v.timer
            entry["samples"]["latency_ms"] = v.latency_ms.tolist()
            entry["samples"]["round"] = v.rounds.tolist()
            entry["samples"]["session"] = list(v.sessions)
            if v.memory_bytes is not None:
                entry["samples"]["memory_bytes"] = v.memory_bytes.tolist()
            entry["outliers"] = v.fences.as_dict() if v.fences is not None else None
        if result.quality is not None:
            entry["samples"]["quality_error"] = result.quality[name].tolist()
        for metric in result.config.metrics:
            entry["summary"][metric] = summary(result.samples(name, metric))
        variants[name] = entry
    return {
        "schema": SCHEMA,
        "config": result.config.as_dict(),
        "fingerprint": result.fingerprint,
        "variants": variants,
        "order": [[s.round, s.position, s.variant] for s in m.order] if m is not None else [],
        "settings": m.settings if m is not None else None,
        "experiment_key": m.experiment if m is not None else None,
        "resumed_samples": m.resumed if m is not None else 0,
        "comparisons": [_finite(c.as_dict()) for c in result.comparisons],
        "cost": [r.as_dict() for r in result.cost],
        "pareto_front": list(result.pareto),
        "regressions": [f"{c.variant}/{c.metric}" for c in result.regressions()],
    }


def summary(values: np.ndarray, confidence: float = 0.95) -> dict[str, Any]:
    """n, mean, sd, min, max and p50/p90/p99 with order-statistic intervals where n allows."""
    out: dict[str, Any] = {
        "n": int(values.size),
        "mean": float(values.mean()),
        "sd": float(values.std(ddof=1)) if values.size > 1 else None,
        "min": float(values.min()),
        "max": float(values.max()),
    }
    for q in QUANTILES:
        label = f"p{round(q * 100)}"
        needed = minimum_size_for_quantile_ci(q, confidence)
        if values.size >= needed:
            ci = quantile_ci(values, q, confidence)
            out[label] = {"estimate": ci.estimate, "interval": list(ci.interval), "coverage": ci.coverage}
        else:
            out[label] = {
                "estimate": float(np.quantile(values, q)),
                "interval": None,
                "note": f"a {confidence:.0%} interval needs n >= {needed}",
            }
    return out


def write_json(result: ExperimentResult, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_json(result), indent=1, allow_nan=False))
    return path


def to_markdown(result: ExperimentResult) -> str:
    cfg, fp = result.config, result.fingerprint
    lines = [f"# A/B experiment: {_text(cfg.name)}", ""]
    git = fp.get("git", {})
    commit = git.get("commit") or f"unknown ({git.get('reason', 'no git')})"
    dirty = " (uncommitted changes)" if git.get("dirty") else ""
    versions = ", ".join(f"{k} {v}" for k, v in fp.get("versions", {}).items())
    lines += [
        f"- baseline: {_code(cfg.baseline)}; metrics: {', '.join(cfg.metrics)}; alpha {cfg.alpha} "
        f"({cfg.correction} correction); {cfg.repetitions} repetitions after {cfg.warmup} warm-up, "
        f"order {cfg.order}, seed {cfg.seed}",
        "- thresholds: " + ", ".join(f"{m} {cfg.threshold(m).describe()}" for m in cfg.metrics),
        f"- commit {commit}{dirty}; {versions}; environment digest {fp.get('digest')}",
    ]
    for dev in fp.get("devices", []):
        caps = dev["capabilities"]
        sim = ", simulated (time and memory are modelled)" if "simulated" in caps.get("features", []) else ""
        lines.append(
            f"- device `{dev['id']}`: {caps['name']} ({caps['arch']}), fingerprint {dev['fingerprint']}{sim}"
        )
    if result.measurement is not None and result.measurement.resumed:
        lines.append(f"- {result.measurement.resumed} samples resumed from the sample store")
    lines += ["", "## Variants", "", _summary_table(result), "", "## Comparisons against the baseline", ""]
    lines += [
        "| metric | variant | median (variant / baseline) | change [CI] | p beyond threshold (corrected) "
        "| power at 2 × threshold | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in result.comparisons:
        unit = METRICS[c.metric].unit
        power = "-" if c.power is None else f"{c.power:.2f}"
        lines.append(
            f"| {c.metric} | {_code(c.variant, cell=True)} | "
            f"{c.median_variant:.4g} / {c.median_baseline:.4g} {unit} "
            f"| {_change(c)} | {c.p_corrected:.3g} | "
            f"{power} | **{c.verdict.value}** |"
        )
    lines += [
        "",
        *[f"- {_code(c.variant)} {c.metric}: {c.verdict.value}: {c.reason}" for c in result.comparisons],
    ]
    if result.cost:
        lines += [
            "",
            "## Cost",
            "",
            "| variant | device | price/h | median latency (ms) | items/s | cost per 10⁶ items | Pareto |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result.cost:
            sim = " (simulated)" if r.simulated else ""
            front = "yes" if r.variant in result.pareto else ""
            lines.append(
                f"| {_code(r.variant, cell=True)} | {r.device}{sim} | {r.price_per_hour:g} | "
                f"{r.median_latency_ms:.4g} | "
                f"{r.throughput:.4g} | {r.cost_per_million_items:.4g} | {front} |"
            )
    return "\n".join(lines) + "\n"


def write_markdown(result: ExperimentResult, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(to_markdown(result))
    return path


def _summary_table(result: ExperimentResult) -> str:
    rows = [
        "| variant | device | metric | n | median [95% CI] | p90 | outliers (Tukey) |",
        "|---|---|---|---|---|---|---|",
    ]
    m = result.measurement
    for name, info in result.variants.items():
        for metric in result.config.metrics:
            s = summary(result.samples(name, metric))
            p50, p90 = s["p50"], s["p90"]
            ci = f" [{p50['interval'][0]:.4g}, {p50['interval'][1]:.4g}]" if p50["interval"] else ""
            flagged = "-"
            if metric == "latency" and m is not None and m.variants[name].fences is not None:
                fences = m.variants[name].fences
                assert fences is not None
                flagged = f"{len(fences.flagged)} ({len(fences.far_out)} far out)"
            rows.append(
                f"| {_code(name, cell=True)} | {info['device']} | {metric} ({METRICS[metric].unit}) | "
                f"{s['n']} | "
                f"{p50['estimate']:.4g}{ci} | {p90['estimate']:.4g} | {flagged} |"
            )
    return "\n".join(rows)


def _text(text: str) -> str:
    """A user's string on one line of Markdown: control characters (a newline would end the
    heading or table row it sits in) shown as escapes, as Python writes them."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _code(text: str, *, cell: bool = False) -> str:
    """A user's string as an inline code span that shows it verbatim: the fence is one backtick
    longer than any run of backticks inside, and in a table cell `|` is escaped (GitHub's tables
    split cells on it even inside code)."""
    body = _text(text)
    if cell:
        body = body.replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall("`+", body)), default=0) + 1)
    pad = " " if body.startswith("`") or body.endswith("`") else ""
    return f"{fence}{pad}{body}{pad}{fence}"


def _change(c: Any) -> str:
    if c.ratio is not None and c.ratio_interval is not None:
        lo, hi = c.ratio_interval
        return f"×{c.ratio:.3f} [{lo:.3f}, {hi:.3f}]"
    lo, hi = c.shift_interval
    return f"{c.shift:+.4g} [{lo:+.4g}, {hi:+.4g}]"


def _finite(data: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: one-sided bounds become null."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
        elif isinstance(value, (tuple, list)):
            out[key] = [None if isinstance(v, float) and not math.isfinite(v) else v for v in value]
        else:
            out[key] = value
    return out
