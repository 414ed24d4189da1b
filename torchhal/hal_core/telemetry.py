"""structlog logging and OpenTelemetry tracing/metrics for torchhal.

Off until configured: spans go to OpenTelemetry's global provider (a no-op unless the
application set one) and logs below TORCHHAL_LOG_LEVEL (default WARNING) cost a level check.
`configure(exporter=...)` gives torchhal its own provider: "console", "otlp" (extra `otlp`) or
"memory" (an InMemorySpanExporter, which tests read). structlog is imported on the first line
actually emitted, so importing torchhal stays cheap. Spans are coarse: discovery, plugin
loading and adapter discovery, kernel selection and fallback, collectives, profiling,
distributed set-up, training steps and checkpoints, evaluation runs, conformance runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from opentelemetry import metrics, trace

from torchhal.hal_core.errors import ConfigurationError

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

EXPORTERS = ("none", "console", "otlp", "memory")
LOG_FORMATS = ("console", "json")
_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_TRACER_NAME = "torchhal"


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tracer: trace.Tracer | None = None  # None: use the global provider
        self.global_tracer: tuple[trace.TracerProvider, trace.Tracer] | None = None  # (provider, its tracer)
        self.meter: metrics.Meter | None = None
        self.span_exporter: InMemorySpanExporter | None = None
        self.metric_reader: InMemoryMetricReader | None = None
        self.providers: tuple[Any, ...] = ()  # torchhal's own tracer and meter providers
        self.instruments: dict[str, metrics.Counter] = {}
        self.counts: Counter[str] = Counter()
        self.log_level = _LEVELS["warning"]
        self.log_format = "console"
        self.log_stream: Any = None  # None: sys.stderr at the time of writing
        # streams a write failed on, written no more: id -> a weak reference (a failed pipe's fd
        # closes with its wrapper), or the stream itself where its type takes no weak references
        self.failed_streams: dict[int, Callable[[], Any]] = {}
        # streams whose last line got only partly into them (EAGAIN): torchhal's next line to one
        # begins with a newline, so that only the fragment is malformed; held as failed_streams
        self.torn_streams: dict[int, Callable[[], Any]] = {}
        self.env_applied = False
        # the settings an explicit configure gave ("exporter", "log_format", "log_level"): the
        # environment's, applied on first use, fill only the others
        self.explicit: set[str] = set()
        self.provider_in_env = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ  # a provider to load


_state = _State()


def configure(
    exporter: str | None = None,
    *,
    log_format: str | None = None,
    log_level: str | None = None,
    log_stream: Any = None,
) -> None:
    """Set the span/metric exporter and the log format and level. Safe to call again.

    All or nothing: every argument is checked and the exporter built before anything is applied,
    so a refused call keeps the earlier setup. Names are case-insensitive, as in the environment.
    """
    _configure(exporter, log_format, log_level, log_stream, from_environment=False)


def _configure(
    exporter: str | None,
    log_format: str | None,
    log_level: str | None,
    log_stream: Any,
    *,
    from_environment: bool,
) -> None:
    """`configure`; `from_environment`: the TORCHHAL_* settings on first use, each of which gives
    way to the same setting given by an explicit configure, whichever came first (checked under
    the lock). An explicit call that sets only the log format leaves the environment's exporter
    to be applied: it used to mark the environment applied, so TORCHHAL_OTEL_EXPORTER was honoured
    or not by call order."""
    exporter = _choice("exporter", exporter, EXPORTERS)
    log_format = _choice("log_format", log_format, LOG_FORMATS)
    log_level = _choice("log_level", log_level, tuple(_LEVELS))
    if log_stream is not None and not callable(
        getattr(log_stream, "write", None)
    ):  # flush optional, as logging's
        raise ConfigurationError(
            f"telemetry log_stream must be a text stream (a callable write), got {log_stream!r}"
        )
    with _state.lock:  # held while building too: a configure racing this one waits, then wins
        given = {"exporter": exporter, "log_format": log_format, "log_level": log_level}
        if from_environment:
            if _state.env_applied:
                return
            exporter, log_format, log_level = (
                None if name in _state.explicit else value for name, value in given.items()
            )
        built = None if exporter is None else _build_exporter(exporter)  # raises before any change
        if built is not None:
            replaced = _state.providers
            _state.tracer, _state.meter, _state.span_exporter, _state.metric_reader, _state.providers = built
            _state.instruments.clear()
            for provider in replaced:  # flush what they hold, stop their export threads
                provider.shutdown()
        if log_format is not None:
            _state.log_format = log_format
        if log_level is not None:
            _state.log_level = _LEVELS[log_level]
        if log_stream is not None:
            _state.log_stream = log_stream
            _state.failed_streams.pop(id(log_stream), None)  # given again: written again
        _Logger.reset_all()
        if from_environment:
            # Only now: a failed call (say TORCHHAL_OTEL_EXPORTER=otlp without the extra) must fail
            # again on the next use, not leave tracing silently off.
            _state.env_applied = True
        else:
            _state.explicit.update(name for name, value in given.items() if value is not None)


def _choice(name: str, value: object, choices: tuple[str, ...]) -> str | None:
    """`value` lower-cased if it names one of `choices`; None stays None (unchanged setting)."""
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in choices:
        raise ConfigurationError(f"telemetry {name} must be one of {choices}, got {value!r}")
    return value.lower()


def reset() -> None:
    """Back to the unconfigured state: no exporter, warning-level console logs to sys.stderr as it
    is when a line is written. For tests: `configure` never unsets a log stream, so one test's
    would otherwise take the next tests' lines."""
    configure(exporter="none", log_level="warning", log_format="console")
    with _state.lock:
        _state.log_stream = None
        _state.failed_streams.clear()
        _state.torn_streams.clear()
        _Logger.reset_all()


class _Built(NamedTuple):
    tracer: trace.Tracer | None
    meter: metrics.Meter | None
    span_exporter: InMemorySpanExporter | None = None
    metric_reader: InMemoryMetricReader | None = None
    providers: tuple[Any, ...] = ()


def _build_exporter(exporter: str) -> _Built:
    """The tracer and meter for `exporter`, built without touching `_state` so a failure here
    (the otlp extra missing) leaves the current setup in place. Metrics go where the spans go:
    with "console" and "otlp" they went nowhere (a meter without a reader)."""
    if exporter == "none":
        return _Built(None, None)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        MetricReader,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    resource = Resource.create({"service.name": "torchhal"})
    provider = TracerProvider(resource=resource)
    span_exporter = metric_reader = None
    reader: MetricReader
    if exporter == "memory":
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        span_exporter, metric_reader = InMemorySpanExporter(), InMemoryMetricReader()
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        reader = metric_reader
    elif exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        reader = PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stderr))
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ConfigurationError(
                "telemetry exporter 'otlp' needs the optional extra: pip install 'torchhal[otlp]'"
            ) from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    meters = MeterProvider(resource=resource, metric_readers=[reader])
    tracer, meter = provider.get_tracer(_TRACER_NAME), meters.get_meter(_TRACER_NAME)
    return _Built(tracer, meter, span_exporter, metric_reader, (provider, meters))


_TELEMETRY_VARIABLES = ("TORCHHAL_OTEL_EXPORTER", "TORCHHAL_LOG_FORMAT", "TORCHHAL_LOG_LEVEL")


def _apply_environment() -> None:
    """Honour the TORCHHAL_OTEL_EXPORTER/LOG_* settings once, on first use rather than at import."""
    if _state.env_applied:
        return
    from torchhal.hal_core.settings import Settings

    # only telemetry's own variables: a bad TORCHHAL_AUTOTUNE broke every log line and counter
    settings = Settings.from_env({k: v for k, v in os.environ.items() if k in _TELEMETRY_VARIABLES})
    _state.provider_in_env = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
    _configure(settings.otel_exporter, settings.log_format, settings.log_level, None, from_environment=True)


def memory_exporter() -> InMemorySpanExporter:
    """The in-memory span exporter set up by `configure(exporter="memory")`."""
    if _state.span_exporter is None:
        raise ConfigurationError('no in-memory exporter: call configure(exporter="memory") first')
    return _state.span_exporter


def metric_reader() -> InMemoryMetricReader:
    if _state.metric_reader is None:
        raise ConfigurationError('no in-memory metric reader: call configure(exporter="memory") first')
    return _state.metric_reader


_UNREADABLE = object()  # an OpenTelemetry without that module global: its getter is always asked


def _tracer() -> trace.Tracer | None:
    """torchhal's own tracer once configured, else the application's global one; None while
    neither exists, so a span then costs a branch, not OpenTelemetry's no-op machinery (which
    still attaches a context: ~15 µs, as much as a small collective)."""
    _apply_environment()
    if _state.tracer is not None:
        return _state.tracer
    # get_tracer_provider() looks os.environ up on every call until a provider is set (~1 µs, a
    # tenth of a small collective); the global it returns is read here, the getter asked only
    # once one exists, or while the environment names one for it to load.
    provider = getattr(trace, "_TRACER_PROVIDER", _UNREADABLE)
    if provider is None and not _state.provider_in_env:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    if _state.global_tracer is None or _state.global_tracer[0] is not provider:
        _state.global_tracer = (provider, provider.get_tracer(_TRACER_NAME))
    return _state.global_tracer[1]


_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def tracing() -> bool:
    """Whether spans are recorded anywhere: lets a hot path skip computing span attributes."""
    return _tracer() is not None


def span(name: str, **attributes: Any) -> AbstractContextManager[trace.Span]:
    """A span named `name`; None-valued attributes are dropped. Exceptions are recorded."""
    tracer = _tracer()
    if tracer is None:
        return _NO_SPAN
    attrs = {k: v for k, v in attributes.items() if v is not None}
    return tracer.start_as_current_span(name, attributes=attrs)


def count(name: str, value: int = 1, **attributes: str) -> None:
    """Increment a counter, both in-process (see `counts()`) and as an OpenTelemetry metric."""
    _apply_environment()
    key = name + "".join(f",{k}={v}" for k, v in sorted(attributes.items()))
    _state.counts[key] += value
    if _state.meter is not None:
        instrument = _state.instruments.get(name)
        if instrument is None:
            instrument = _state.instruments[name] = _state.meter.create_counter(name)
        instrument.add(value, attributes)


def counts() -> dict[str, int]:
    return dict(_state.counts)


def _otel_ids(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event["trace_id"] = format(ctx.trace_id, "032x")
        event["span_id"] = format(ctx.span_id, "016x")
    return event


class _Logger:
    """A structlog logger made on the first line that passes the level check."""

    # weak: get_logger called per request kept every logger it ever made alive
    _all: ClassVar[weakref.WeakSet[_Logger]] = weakref.WeakSet()
    _all_lock: ClassVar[threading.Lock] = threading.Lock()  # a set may not grow while iterated

    def __init__(self, name: str) -> None:
        self.name = name
        # (stream, the structlog logger writing to it), read and written as one value: kept in two
        # attributes, two threads' lines could leave a logger paired with another's stream
        self._bound: tuple[Any, Any] | None = None
        with _Logger._all_lock:
            _Logger._all.add(self)

    @classmethod
    def reset_all(cls) -> None:
        with cls._all_lock:
            for logger in cls._all:
                logger._bound = None

    def _emit(self, level: str, event: str, kw: dict[str, Any]) -> None:
        _apply_environment()
        if _LEVELS[level] < _state.log_level:
            return
        # sys.stderr as it is now: a logger kept the one of its first line, and wrote to it
        # closed once that was a capture (contextlib.redirect_stderr, pytest's) that had ended
        # (`is None`: a stream whose len() is 0 is still the one given). sys.stderr is None under
        # pythonw, in Windows services, with fd 2 closed: the line is dropped, not sent to stdout
        # (which may be the program's data)
        stream = _state.log_stream if _state.log_stream is not None else sys.stderr
        if stream is None or _holds(_state.failed_streams, stream):
            count("torchhal.log.lines_dropped")
            return
        bound = self._bound  # read once: a configure() in another thread resets it to None
        if bound is None or bound[0] is not stream:
            bound = self._bound = (stream, _make_structlog(self.name, stream))
        # errors of rendering (a value's __repr__) are the caller's, raised; the stream's own are
        # handled by _StreamLogger
        getattr(bound[1], level)(event, **kw)

    def debug(self, event: str, **kw: Any) -> None:
        self._emit("debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._emit("info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit("warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit("error", event, kw)

    def is_enabled_for(self, level: str) -> bool:
        return _LEVELS[level] >= _state.log_level


class _StreamLogger:
    """structlog's logger: each rendered line goes to `stream` in one write, and only the errors of
    the stream's own write and flush are handled here (structlog's PrintLogger printed the line and
    its newline apart, and took weak references the stream's type may not allow). A stream without
    `flush` is written without.

    A character the stream's encoding lacks is written backslash-escaped (`\\xe4`): an ASCII or
    cp1252 stream raised UnicodeEncodeError out of the user's call. Where that fails too (an
    encoding Python does not know, a stream that says utf-8 and writes ASCII) the line is dropped,
    counted; a tee may have written part of it to its first stream already.

    A stream that would block (a full non-blocking pipe, EAGAIN) is flushed before the line: while
    it still holds earlier output the line is dropped, counted, and once it has room, io's buffered
    classes take the whole line (a BlockingIOError saying 0 characters written is then the
    line-buffered flush of a line they hold, not a loss). A line of which only part got in (longer
    than the buffer) is counted dropped too, and the next line to that stream begins with a
    newline: only the fragment is malformed, not the line after it. The stream stays in use.

    Any other OSError, or a ValueError of a closed stream, fails the stream (`_stream_failed`);
    another ValueError is the stream's bug, raised."""

    # lines of two threads are not interleaved; reentrant, as logging's handler locks: a signal
    # handler that logs runs in the thread it interrupts, maybe in the middle of a write
    _lock: ClassVar[threading.RLock] = threading.RLock()

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        with self._lock:
            try:
                self._write(message + "\n")
            except (OSError, ValueError) as exc:
                # a ValueError is a closed stream's ("I/O operation on closed file"), or a bug to see
                if isinstance(exc, ValueError) and not getattr(self._stream, "closed", False):
                    raise
                _stream_failed(self._stream, exc)

    debug = info = warning = error = critical = msg  # the levels structlog's loggers call

    def _write(self, line: str) -> None:
        stream = self._stream
        flush = getattr(stream, "flush", None)
        if flush is not None:
            try:
                flush()  # earlier output out first: its buffer then has room for the whole line
            except BlockingIOError:  # still full: the line is not written
                count("torchhal.log.lines_dropped")
                return
        if _holds(_state.torn_streams, stream):
            line = "\n" + line  # ends the fragment of the last line
        wrote = False
        try:
            try:
                stream.write(line)
            except UnicodeEncodeError as exc:  # nothing written yet: the text is encoded first
                try:
                    stream.write(_escaped(line, stream, exc))
                except (LookupError, UnicodeError):  # no encoding the stream writes in is known
                    count("torchhal.log.lines_dropped")
                    return
            wrote = True
            if flush is not None:
                flush()
        except BlockingIOError as exc:
            # how much of the line the stream took, as io's buffered classes say: 0 where the line
            # is in their buffer and only its flush would block (a line-buffered write flushes)
            written = getattr(exc, "characters_written", 0 if wrote else None)
            if written != 0:  # None: nothing of the line got in; more: only part of it
                count("torchhal.log.lines_dropped")
                if written:
                    _hold(_state.torn_streams, stream)
                return
        _state.torn_streams.pop(id(stream), None)


def _escaped(line: str, stream: Any, exc: UnicodeEncodeError) -> str:
    """`line` with the characters that the stream's encoding lacks backslash-escaped."""
    encoding = getattr(stream, "encoding", None)
    encoding = encoding if isinstance(encoding, str) else exc.encoding
    return line.encode(encoding, "backslashreplace").decode(encoding)


def _holds(streams: dict[int, Callable[[], Any]], stream: Any) -> bool:
    held = streams.get(id(stream))
    return held is not None and held() is stream


def _hold(streams: dict[int, Callable[[], Any]], stream: Any) -> None:
    """Puts `stream` in `streams` by a weak reference, so it (and a pipe's fd) is not kept open
    for good; directly where its type takes no weak references (held until reset() or
    configure())."""
    key = id(stream)

    def forget(ref: weakref.ref[Any]) -> None:  # the stream is gone: its id may be reused
        if streams.get(key) is ref:
            streams.pop(key, None)

    try:
        streams[key] = weakref.ref(stream, forget)
    except TypeError:
        streams[key] = lambda: stream


def _stream_failed(stream: Any, exc: Exception) -> None:
    """A log stream a write failed on (a pipe whose reader exited, as `torchhal info 2>&1 | head
    -1` leaves stderr; a file closed under the logger) is written no more: the error raised out of
    the user's op call, and `torchhal info` printed nothing. Its lines are counted as dropped, and
    the failure said once on the process's own stderr unless that is the stream that failed.
    Remembered by a weak reference (`_hold`)."""
    with _state.lock:
        if _holds(_state.failed_streams, stream):
            return  # another thread's line met the failure first and said so
        _hold(_state.failed_streams, stream)
    _Logger.reset_all()  # loggers let go of it too (rebuilt on their next line)
    count("torchhal.log.lines_dropped")
    notice = sys.__stderr__
    if notice is None or notice is stream:
        return
    with contextlib.suppress(OSError, ValueError):  # that one broken too: nowhere left to say it
        print(
            f"torchhal: log stream {stream!r} failed ({type(exc).__name__}: {exc}); "
            "torchhal's log lines to it are dropped (counted as torchhal.log.lines_dropped)",
            file=notice,
            flush=True,
        )


def _make_structlog(name: str, stream: Any) -> Any:
    import structlog

    # JSON: a traceback as text (`exc_info=True` was written `true`), and always valid JSON
    json_only = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(_json_line)]
    # console: Python's own traceback text for exc_info; structlog's default formatter (rich's, or
    # better-exceptions') printed every frame's locals: whole tensors, tokens, secrets in variables
    console = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    return structlog.wrap_logger(
        _StreamLogger(stream),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _otel_ids,
            *(json_only if _state.log_format == "json" else [console]),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        context_class=dict,
    ).bind(logger=name)


def _json_line(event: dict[str, Any], **dumps: Any) -> str:
    """One log line as strict JSON (RFC 8259) whatever the values: json.dumps wrote NaN and
    Infinity bare (log shippers refuse the line) and raised on a key that is not a string, number
    or None (the user's log call raised). Those are written as their repr, as unknown objects are."""
    try:
        return json.dumps(event, allow_nan=False, **dumps)
    except (TypeError, ValueError):  # an odd key, a float out of JSON, a container holding itself
        return json.dumps(_jsonable(event, frozenset()), allow_nan=False, **dumps)


def _jsonable(value: Any, outer: frozenset[int]) -> Any:
    """`value` with non-finite floats and keys JSON lacks as repr strings; a container met again
    inside itself (`outer`: the ids of those around it) as a marker."""
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if not isinstance(value, (dict, list, tuple)):
        return value
    if id(value) in outer:
        return "<cycle>"
    inner = outer | {id(value)}
    if isinstance(value, dict):
        return {
            (k if isinstance(k, (str, int, bool)) or k is None else repr(k)): _jsonable(v, inner)
            for k, v in value.items()
        }
    return [_jsonable(v, inner) for v in value]


def get_logger(name: str) -> _Logger:
    return _Logger(name)
