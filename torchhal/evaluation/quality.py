"""Quality: how far each variant's output lies from a reference variant's, input set by input set.

Variants are aligned by input set: set i of every variant is the same logical input (converted
explicitly where a variant runs another dtype or device). Outputs are compared in float64 on
the host, an explicit copy and upcast made only for the comparison. Errors:
* "rel_l2": ‖y − r‖₂ / ‖r‖₂ over all output elements;
* "max_abs": max |y − r|;
* "kl": mean over rows of KL(softmax(r) ‖ softmax(y)) along the last dimension, for variants
  whose output is logits (a language model's next-token distribution).
One value per input set forms the quality sample that `compare` tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from torchhal.evaluation.fingerprint import digest, environment_fingerprint, warn_resumed
from torchhal.evaluation.harness import Variant, check_group
from torchhal.evaluation.store import SampleStore
from torchhal.hal_core import InvalidArgumentError, telemetry

log = telemetry.get_logger("torchhal.evaluation.quality")

ERRORS = ("rel_l2", "max_abs", "kl")


def output_error(output: Any, reference: Any, kind: str, what: str) -> float:
    """The error of `output` against `reference` (tensors or tuples/lists of tensors)."""
    if kind not in ERRORS:
        raise InvalidArgumentError(f"quality error must be one of {ERRORS}, got {kind!r}")
    ys, rs = _flat(output, f"{what}: output"), _flat(reference, f"{what}: reference output")
    if len(ys) != len(rs) or any(y.shape != r.shape for y, r in zip(ys, rs, strict=True)):
        raise InvalidArgumentError(
            f"{what}: output shapes {[tuple(y.shape) for y in ys]} differ from the reference's "
            f"{[tuple(r.shape) for r in rs]}"
        )
    for name, group in (("output", ys), ("reference output", rs)):
        for t in group:
            if not torch.isfinite(t).all():
                raise InvalidArgumentError(f"{what}: the {name} holds NaN or inf values")
    if kind == "kl":
        if len(ys) != 1 or ys[0].dim() < 1:
            raise InvalidArgumentError(
                f"{what}: 'kl' needs one logits tensor of rank >= 1, got {len(ys)} tensor(s)"
            )
        log_p = torch.log_softmax(rs[0], dim=-1)
        log_q = torch.log_softmax(ys[0], dim=-1)
        return float((log_p.exp() * (log_p - log_q)).sum(dim=-1).mean())
    y = torch.cat([t.reshape(-1) for t in ys])
    r = torch.cat([t.reshape(-1) for t in rs])
    if kind == "max_abs":
        return float((y - r).abs().max()) if y.numel() else 0.0
    norm = float(torch.linalg.vector_norm(r))
    if norm == 0.0:
        raise InvalidArgumentError(
            f"{what}: the reference output is all zeros, so 'rel_l2' is undefined; use 'max_abs'"
        )
    return float(torch.linalg.vector_norm(y - r)) / norm


def measure_quality(
    variants: Sequence[Variant],
    reference: str,
    *,
    kind: str = "rel_l2",
    store: SampleStore | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Per variant, the error of its output on each input set against the reference variant's."""
    check_group(list(variants))  # errors are kept by name: a repeated name would overwrite one
    by_name = {v.name: v for v in variants}
    if reference not in by_name:
        raise InvalidArgumentError(
            f"quality reference {reference!r} is not a variant; variants: {sorted(by_name)}"
        )
    if kind not in ERRORS:
        raise InvalidArgumentError(f"quality error must be one of {ERRORS}, got {kind!r}")
    ref = by_name[reference]
    n = len(ref.inputs)
    mismatched = {v.name: len(v.inputs) for v in variants if len(v.inputs) != n}
    if mismatched:
        raise InvalidArgumentError(
            f"quality compares input set i of every variant with set i of {reference!r} ({n} sets); "
            f"these variants have another number of sets: {mismatched}"
        )
    fingerprint = environment_fingerprint(v.device for v in variants)
    experiment = digest(
        {
            "kind": "quality",
            "error": kind,
            "reference": ref.key_data(),
            "variants": [v.key_data() for v in variants],
            "environment": fingerprint["digest"],
        }
    )
    errors = {v.name: np.empty(n) for v in variants}
    done, total, resumed = 0, n * len(variants), 0
    with telemetry.span("torchhal.evaluation.quality", variants=sorted(by_name), reference=reference, sets=n):
        for i in range(n):
            # the set's index as well as its content: equal sets are still separate samples
            key = f"quality:{kind}:{i}:{ref.inputs.hash(i)}"
            cached = {v.name: store.get(experiment, v.name, key) if store else None for v in variants}
            missing = [v for v in variants if cached[v.name] is None]
            expected = _host(_call(ref, i)) if missing else None
            for v in variants:
                row = cached[v.name]
                if row is None:
                    value = output_error(
                        _host(_call(v, i)), expected, kind, f"variant {v.name!r}, input set {i}"
                    )
                    if store is not None:
                        store.put(experiment, v.name, key, {"error": value, "set": i})
                else:
                    value = float(row["error"])
                    resumed += 1
                errors[v.name][i] = value
                done += 1
                if progress is not None:
                    progress(done, total)
    warn_resumed(fingerprint, experiment, resumed)
    return errors


def _call(variant: Variant, index: int) -> Any:
    with variant.active():
        return variant.call(index)


def _host(value: Any) -> Any:
    """An explicit float64 host copy of every floating tensor, for comparison only."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=torch.float64)
    if isinstance(value, (tuple, list)):
        return [_host(v) for v in value]
    raise InvalidArgumentError(
        f"quality compares tensor outputs (or tuples/lists of them), got {type(value).__name__}"
    )


def _flat(value: Any, what: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v, what)]
    raise InvalidArgumentError(f"{what}: expected tensors, got {type(value).__name__}")
