"""A recording that lacks a fact no adapter can do without, or is no JSON object, is refused
naming the recording and the fact (they raised a bare KeyError or JSONDecodeError)."""

from __future__ import annotations

import pytest

from torchhal.hal_core import InvalidArgumentError
from torchhal.hal_core.recorded import RecordedProbe


@pytest.mark.parametrize("fact", ["available", "runtime"])
def test_a_missing_fact_is_named(fact):
    probe = RecordedProbe({"source": "h100.json", "available": True, "runtime": {"version": "12"}})
    del probe.facts[fact]
    with pytest.raises(InvalidArgumentError, match=rf"recorded probe 'h100.json': no '{fact}' recorded"):
        getattr(probe, fact)()


def test_missing_device_properties_are_named_with_the_device():
    probe = RecordedProbe(
        {"source": "mi300x.json", "devices": [{"properties": {"name": "x"}}, {"memory": {}}]}
    )
    assert probe.properties(0) == {"name": "x"}
    with pytest.raises(InvalidArgumentError, match=r"'mi300x.json': no 'properties' recorded for device 1"):
        probe.properties(1)


@pytest.mark.parametrize(
    ("text", "problem"), [("{not json", "not JSON"), ("[1, 2]", "must hold a JSON object, got list")]
)
def test_a_file_that_is_no_recording_is_named(tmp_path, text, problem):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match=rf"recorded probe '.*broken.json': {problem}"):
        RecordedProbe.from_file(path)
