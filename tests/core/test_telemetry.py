"""Telemetry: spans for discovery, plugin loading and kernel selection; log lines with trace ids."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import ConfigurationError, telemetry


def test_discovery_plugin_load_and_selection_spans(plugin_dist, settings):
    plugin_dist(
        "traced",
        "from torchhal.hal_core import hookimpl\n@hookimpl\ndef torchhal_adapters():\n    return []\n",
    )
    telemetry.configure(exporter="memory")
    hal = HardwareAbstractionLayer(settings=settings())
    hal.kernels.call("rms_norm", hal.device("cpu"), torch.randn(3, 5), torch.randn(5))
    hal.kernels.call("rms_norm", hal.device("cpu"), torch.randn(4, 5), torch.randn(5))  # cached: no span
    spans = telemetry.memory_exporter().get_finished_spans()
    names = [s.name for s in spans]
    assert names.count("torchhal.discovery") == 1
    assert names.count("torchhal.kernel.select") == 1
    loads = {s.attributes["plugin"] for s in spans if s.name == "torchhal.plugin.load"}
    assert {"traced", "builtin-kernels"} <= loads
    discovery = next(s for s in spans if s.name == "torchhal.discovery")
    adapter_spans = [s for s in spans if s.name == "torchhal.adapter.discover"]
    assert all(s.parent.span_id == discovery.context.span_id for s in adapter_spans)
    select = next(s for s in spans if s.name == "torchhal.kernel.select")
    assert select.attributes["torchhal.kernel.candidate"] == "torchhal/aten"


def test_json_log_lines_carry_trace_and_span_ids():
    stream = io.StringIO()
    telemetry.configure(exporter="memory", log_format="json", log_level="info", log_stream=stream)
    log = telemetry.get_logger("torchhal.test")
    with telemetry.span("outer") as span:
        log.info("inside", answer=42)
    log.info("outside")
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    ctx = span.get_span_context()
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert (inside["event"], inside["answer"], inside["level"], inside["logger"]) == (
        "inside",
        42,
        "info",
        "torchhal.test",
    )
    assert "trace_id" not in outside


def test_lines_below_the_level_are_not_written():
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    telemetry.get_logger("torchhal.test").info("quiet")
    assert stream.getvalue() == ""


def test_unconfigured_spans_are_no_ops():
    telemetry.configure(exporter="none")
    with telemetry.span("nothing") as span:
        assert not span.is_recording()


def test_spans_go_to_the_application_provider_once_it_sets_one():
    """Unconfigured torchhal spans cost a branch; an application's own global provider, set after
    torchhal's first span (OpenTelemetry allows it once per process, hence the subprocess), gets them."""
    script = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torchhal.hal_core import telemetry
with telemetry.span("before") as span:
    assert not span.is_recording()
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
with telemetry.span("after", op="x", skipped=None):
    pass
(done,) = exporter.get_finished_spans()
assert done.name == "after" and dict(done.attributes) == {"op": "x"}, done
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHHAL_", "OTEL_"))}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)


def test_a_provider_named_in_the_environment_gets_the_spans():
    """OpenTelemetry loads the provider OTEL_PYTHON_TRACER_PROVIDER names on first use; the cheap
    unconfigured check must not skip that load."""
    script = """
from torchhal.hal_core import telemetry
assert telemetry.tracing()
with telemetry.span("loaded") as span:
    assert span.is_recording(), span
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHHAL_", "OTEL_"))}
    env["OTEL_PYTHON_TRACER_PROVIDER"] = "sdk_tracer_provider"
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)


@pytest.fixture
def no_otlp_extra(monkeypatch):
    """The otlp extra uninstalled, whether or not it is here: a None in sys.modules fails the import."""
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)


def test_otlp_without_its_extra_names_the_extra(no_otlp_extra):
    with pytest.raises(ConfigurationError, match=r"torchhal\[otlp\]"):
        telemetry.configure(exporter="otlp")


def test_a_bad_environment_exporter_fails_every_hal_not_only_the_first(monkeypatch, no_otlp_extra, settings):
    """The environment is applied on first use; a failed apply must fail again on the next HAL
    rather than leave that one running with tracing silently off."""
    monkeypatch.setenv("TORCHHAL_OTEL_EXPORTER", "otlp")
    monkeypatch.setattr(telemetry._state, "env_applied", False)  # as in a fresh process
    monkeypatch.setattr(telemetry._state, "explicit", set())
    for _ in range(2):
        with pytest.raises(ConfigurationError, match=r"torchhal\[otlp\]"):
            HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1")).devices()


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"exporter": "otlp"}, id="otlp-extra-missing"),
        pytest.param({"log_stream": "stderr"}, id="stream-without-write"),
    ],
)
def test_a_refused_configure_keeps_the_earlier_setup(no_otlp_extra, bad):
    stream = io.StringIO()
    telemetry.configure(exporter="memory", log_level="warning", log_stream=stream)
    exporter = telemetry.memory_exporter()
    with pytest.raises(ConfigurationError):
        telemetry.configure(log_level="debug", log_format="json", **bad)
    telemetry.get_logger("torchhal.test").debug("still below the level")
    with telemetry.span("kept"):
        pass
    assert stream.getvalue() == ""
    assert telemetry.memory_exporter() is exporter
    assert [s.name for s in exporter.get_finished_spans()] == ["kept"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param(
            {"log_level": 3}, r"log_level must be one of \('debug', .*'critical'\), got 3$", id="level"
        ),
        pytest.param(
            {"log_format": "xml"}, r"log_format must be one of \('console', 'json'\), got 'xml'$", id="format"
        ),
        pytest.param(
            {"exporter": "zipkin"},
            r"exporter must be one of \('none', .*'memory'\), got 'zipkin'$",
            id="exporter",
        ),
        pytest.param({"log_stream": "stderr"}, r"log_stream must be .*write.*, got 'stderr'$", id="stream"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument_choices_and_value(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        telemetry.configure(**kwargs)


def test_names_are_case_insensitive_in_configure_as_in_the_environment(monkeypatch):
    stream = io.StringIO()
    telemetry.configure(exporter="Memory", log_format="JSON", log_level="INFO", log_stream=stream)
    telemetry.get_logger("torchhal.test").info("shown")
    with telemetry.span("from-configure"):
        pass
    assert json.loads(stream.getvalue())["event"] == "shown"
    assert [s.name for s in telemetry.memory_exporter().get_finished_spans()] == ["from-configure"]
    telemetry.reset()
    monkeypatch.setenv("TORCHHAL_OTEL_EXPORTER", "MEMORY")
    monkeypatch.setattr(telemetry._state, "env_applied", False)
    monkeypatch.setattr(telemetry._state, "explicit", set())
    with telemetry.span("from-env"):
        pass
    assert [s.name for s in telemetry.memory_exporter().get_finished_spans()] == ["from-env"]


def test_public_telemetry_module_configures_the_core_and_its_spans_arrive(settings):
    """`torchhal.telemetry` is the documented face (DESIGN.md): the same functions as the core's,
    so configuring it routes the HAL's own spans to the exporter."""
    import torchhal
    import torchhal.telemetry as public

    assert torchhal.telemetry is public
    assert all(getattr(public, name) is getattr(telemetry, name) for name in public.__all__)
    public.configure(exporter="memory")
    HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1")).devices()
    with public.span("torchhal.test.public", answer=42):
        pass
    spans = {s.name: s for s in public.memory_exporter().get_finished_spans()}
    assert "torchhal.discovery" in spans
    assert spans["torchhal.test.public"].attributes["answer"] == 42


def test_import_torchhal_does_not_load_telemetry():
    code = (
        "import sys, torchhal;"
        "heavy = ('torchhal.telemetry', 'torchhal.hal_core', 'opentelemetry');"
        "bad = [m for m in sys.modules if m.startswith(heavy)];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_an_explicit_configure_wins_over_the_environment_being_applied_meanwhile(monkeypatch):
    """The environment, applied on another thread's first use while an explicit configure ran,
    overwrote it after it returned (found by review): building the exporter now holds the lock."""
    import threading

    monkeypatch.setattr(telemetry._state, "env_applied", False)  # as in a fresh process
    monkeypatch.setattr(telemetry._state, "explicit", set())
    monkeypatch.setenv("TORCHHAL_OTEL_EXPORTER", "console")
    monkeypatch.setenv("TORCHHAL_LOG_LEVEL", "warning")
    started, release = threading.Event(), threading.Event()
    build = telemetry._build_exporter

    def slow_build(exporter):
        started.set()
        release.wait(10)
        return build(exporter)

    monkeypatch.setattr(telemetry, "_build_exporter", slow_build)
    first_use = threading.Thread(target=telemetry._apply_environment)
    first_use.start()
    assert started.wait(10)
    explicit = threading.Thread(target=lambda: telemetry.configure(log_level="debug"))
    explicit.start()
    explicit.join(0.2)  # with the bug it returns here, before the environment is applied
    release.set()
    first_use.join(10)
    explicit.join(10)
    assert telemetry._state.log_level == telemetry._LEVELS["debug"]


def test_an_explicit_configure_leaves_the_environments_other_settings_applied(monkeypatch):
    """configure(log_format="json") marked the whole environment applied, so an exporter set by
    TORCHHAL_OTEL_EXPORTER was honoured or not depending on which came first."""
    monkeypatch.setattr(telemetry._state, "env_applied", False)  # as in a fresh process
    monkeypatch.setattr(telemetry._state, "explicit", set())
    monkeypatch.setenv("TORCHHAL_OTEL_EXPORTER", "memory")
    monkeypatch.setenv("TORCHHAL_LOG_FORMAT", "console")
    telemetry.configure(log_format="json")
    with telemetry.span("work"):
        pass
    assert [s.name for s in telemetry.memory_exporter().get_finished_spans()] == ["work"]
    assert telemetry._state.log_format == "json"  # the explicit setting kept


def test_an_unrelated_bad_setting_does_not_break_telemetry(monkeypatch):
    """Telemetry validated every TORCHHAL_ setting: a bad TORCHHAL_AUTOTUNE made each log line and
    counter raise, HALs given explicit Settings included."""
    monkeypatch.setattr(telemetry._state, "env_applied", False)
    monkeypatch.setattr(telemetry._state, "explicit", set())
    monkeypatch.setenv("TORCHHAL_AUTOTUNE", "true")
    monkeypatch.setenv("TORCHHAL_LOG_LEVEL", "error")
    telemetry.count("torchhal.test.unrelated_setting")
    assert telemetry._state.log_level == telemetry._LEVELS["error"]
