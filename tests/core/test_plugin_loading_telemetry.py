"""What plugin loading tells a trace, and what loggers cost to keep."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref

from opentelemetry.trace import StatusCode

from tests.core.adapters import FakeAdapter
from tests.core.test_plugins import adapter_plugin, kernel_plugin
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import telemetry


def test_spans_of_plugin_loading_and_adapter_discovery_carry_their_outcome(plugin_dist, settings):
    """A plugin that failed to import, and an absent adapter, left spans exactly like a plugin
    that loaded: status unset, nothing about the failure."""
    plugin_dist("broken", "import torchhal_no_such_module_xyz\n")
    plugin_dist("good", adapter_plugin("good"))
    plugin_dist(
        "typo", "from torchhal.hal_core import hookimpl\n@hookimpl\ndef torchhal_adapterz():\n    return []\n"
    )
    plugin_dist("halfway", kernel_plugin("halfway", then="raise RuntimeError('second candidate broke')"))
    telemetry.configure(exporter="memory")
    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter(available=False)], settings=settings(plugins="broken,good,typo,halfway")
    )
    hal.devices()
    spans = telemetry.memory_exporter().get_finished_spans()
    loads = {s.attributes["plugin"]: s for s in spans if s.name == "torchhal.plugin.load"}
    broken = loads["broken"]
    assert broken.status.status_code is StatusCode.ERROR
    assert "import: ModuleNotFoundError" in (broken.status.description or "")
    assert (broken.attributes["torchhal.status"], broken.attributes["torchhal.stage"]) == ("failed", "import")
    assert "torchhal_no_such_module_xyz" in broken.attributes["torchhal.reason"]
    assert loads["typo"].status.status_code is StatusCode.ERROR
    assert "implements torchhal_adapterz" in loads["typo"].attributes["torchhal.reason"]
    assert loads["good"].status.status_code is StatusCode.UNSET
    found = {s.attributes["adapter"]: s for s in spans if s.name == "torchhal.adapter.discover"}
    assert found["acme"].attributes["torchhal.status"] == "absent"
    assert found["acme"].attributes["torchhal.reason"] == "no acme"
    assert found["good"].attributes["torchhal.status"] == "loaded"
    assert found["good"].status.status_code is StatusCode.UNSET
    # a failure with no span of its own (a kernel hook's) is an event on the discovery span
    (discovery,) = [s for s in spans if s.name == "torchhal.discovery"]
    events = [dict(e.attributes) for e in discovery.events if e.name == "torchhal.plugin.failed"]
    assert [(e["plugin"], e["stage"]) for e in events] == [("halfway", "kernels")]
    assert "second candidate broke" in events[0]["reason"]
    assert discovery.status.status_code is StatusCode.UNSET


def test_loggers_no_longer_used_are_not_kept_alive():
    """`get_logger` registered every logger it made in a class-level list, forever."""
    logger = telemetry.get_logger("torchhal.test.per-request")
    ref = weakref.ref(logger)
    del logger
    gc.collect()
    assert ref() is None
    kept = telemetry.get_logger("torchhal.test.kept")
    telemetry.configure(log_level="info")  # resets every live logger; must not trip on dead ones
    assert ref() is None and kept.is_enabled_for("info")


def test_console_exporter_exports_metrics_too():
    """With "console" (and "otlp") the counters went to a meter without a reader: nowhere."""
    code = (
        "from torchhal.hal_core import telemetry\n"
        "telemetry.configure(exporter='console')\n"
        "telemetry.count('torchhal.test.sweep18', plugin='p')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert '"name": "torchhal.test.sweep18"' in done.stderr  # exported at exit, on stderr
    assert done.stdout == ""


def test_configuring_again_shuts_the_replaced_providers_down():
    """Each configure left its providers registered with atexit, so every in-memory exporter
    (with its spans) and every export thread lived until the process ended."""
    telemetry.configure(exporter="memory")
    with telemetry.span("kept until shutdown"):
        pass
    first = weakref.ref(telemetry.memory_exporter())
    telemetry.configure(exporter="memory")
    gc.collect()
    assert first() is None
    threads = threading.active_count()
    for _ in range(3):
        telemetry.configure(exporter="console")  # each starts a periodic metric export thread
    assert threading.active_count() <= threads + 1
    telemetry.configure(exporter="none")
    assert threading.active_count() <= threads
