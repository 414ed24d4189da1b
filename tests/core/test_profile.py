"""The profile cache: a cached profile is used; an unusable one is a logged miss, measured again."""

from __future__ import annotations

import json

import pytest

from tests.core.adapters import FakeAdapter
from tests.core.test_capabilities import measured
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import SCHEMA_VERSION, telemetry
from torchhal.hal_core import profile as profile_module


@pytest.fixture
def hal(settings, tmp_path):
    return HardwareAbstractionLayer(
        adapters=[FakeAdapter()], settings=settings(disable_plugin_autoload="1", cache_dir=str(tmp_path))
    )


@pytest.fixture
def measurements(monkeypatch, hal):
    """Replaces the micro-benchmarks (seconds of work) with a record of each device measured."""
    done: list[str] = []

    def measure(_hal, device):
        done.append(device.id)
        return measured(fingerprint=profile_module.fingerprint(device), device_id=device.id)

    monkeypatch.setattr(profile_module, "measure", measure)
    return done


def test_a_cached_profile_is_read_not_measured(hal, measurements):
    first = hal.profile("acme:0")
    fresh = HardwareAbstractionLayer(adapters=[FakeAdapter()], settings=hal.settings)
    assert fresh.profile("acme:0") == first
    assert measurements == ["acme:0"]


@pytest.mark.parametrize(
    ("stale", "reason"),
    [
        (lambda doc: json.dumps({**doc, "schema_version": 0}), "reads schema_version 1, got 0"),
        (lambda doc: json.dumps(doc)[:40], "Invalid JSON"),  # a truncated file
        (lambda doc: json.dumps({**doc, "copy_bytes": "lots"}), "copy_bytes: "),
    ],
    ids=["old-schema-version", "torn", "invalid-field"],
)
def test_an_unusable_cached_profile_is_measured_again_and_logged(hal, measurements, capsys, stale, reason):
    device = hal.device("acme:0")
    path = profile_module.cache_path(hal.settings.cache_dir, device)
    path.parent.mkdir(parents=True)
    doc = measured(fingerprint=profile_module.fingerprint(device)).model_dump(mode="json")
    path.write_text(stale(doc))
    telemetry.configure(log_format="json")

    got = hal.profile(device)

    assert measurements == ["acme:0"] and got.schema_version == SCHEMA_VERSION
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION  # the cache is replaced
    (line,) = (json.loads(raw) for raw in capsys.readouterr().err.splitlines())
    assert (line["level"], line["event"]) == ("warning", "cached profile unusable; measuring again")
    assert line["path"] == str(path) and reason in line["reason"]
