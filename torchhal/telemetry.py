"""torchhal's telemetry, as applications use it: `configure(exporter="console"|"otlp"|"memory")`.

The implementation lives in `torchhal.hal_core.telemetry` (the core emits the spans and logs and
must not import outside `hal_core`); this module is its public face. Importing it loads the
core's contracts and the OpenTelemetry API, not torch; the SDK, exporters and structlog load
when configured or first used.
"""

from __future__ import annotations

from torchhal.hal_core.telemetry import (
    EXPORTERS,
    LOG_FORMATS,
    configure,
    count,
    counts,
    get_logger,
    memory_exporter,
    metric_reader,
    span,
    tracing,
)

__all__ = [
    "EXPORTERS",
    "LOG_FORMATS",
    "configure",
    "count",
    "counts",
    "get_logger",
    "memory_exporter",
    "metric_reader",
    "span",
    "tracing",
]
