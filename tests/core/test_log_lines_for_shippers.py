"""An ML platform's operations: log lines a log shipper reads, streams that change."""

from __future__ import annotations

import contextlib
import io
import json
import random

from torchhal.hal_core import telemetry


def _strict(raw: str) -> dict:
    """A line as an RFC 8259 parser reads it: NaN and Infinity are not JSON."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(raw, parse_constant=refuse)


def test_log_lines_go_to_stderr_as_it_is_when_written():
    """A logger kept the sys.stderr of its first line: after a capture of stderr ended (pytest's,
    contextlib.redirect_stderr), its next line raised ValueError (I/O operation on closed file)."""
    log = telemetry.get_logger(f"ops20.{random.randint(0, 999)}")
    with contextlib.redirect_stderr(first := io.StringIO()):
        log.warning("first line")
    first.close()
    with contextlib.redirect_stderr(second := io.StringIO()):
        log.warning("second line")
    assert "second line" in second.getvalue()


def test_json_lines_are_strict_json_with_non_finite_numbers():
    """NaN and infinity were written bare (`"loss": NaN`), which JSON parsers refuse."""
    telemetry.configure(log_format="json", log_stream=(stream := io.StringIO()))
    finite = random.random()
    telemetry.get_logger("ops20").warning(
        "figures", loss=float("nan"), rate=[float("inf"), finite], peak={"a": float("-inf")}
    )
    line = _strict(stream.getvalue())
    assert (line["loss"], line["rate"], line["peak"]) == ("nan", ["inf", finite], {"a": "-inf"})


def test_json_lines_with_keys_json_lacks_do_not_raise():
    """A dict keyed by tuples made the log call itself raise TypeError (the console format wrote
    it); a dict holding itself raised ValueError."""
    telemetry.configure(log_format="json", log_stream=(stream := io.StringIO()))
    n = random.randint(0, 99)
    cycle: dict = {"n": n}
    cycle["self"] = cycle
    telemetry.get_logger("ops20").warning("by shape", times={(n, 2): 1.5, 3: 2.0, None: 0}, cycle=cycle)
    line = _strict(stream.getvalue())
    assert line["times"] == {f"({n}, 2)": 1.5, "3": 2.0, "null": 0}
    assert line["cycle"] == {"n": n, "self": "<cycle>"}


def test_json_lines_carry_the_traceback_of_exc_info():
    """`exc_info=True` was written `"exc_info": true`: the traceback was lost."""
    telemetry.configure(log_format="json", log_stream=(stream := io.StringIO()))
    message = f"odd shape {random.randint(0, 999)}"
    try:
        raise ValueError(message)
    except ValueError:
        telemetry.get_logger("ops20").error("step failed", exc_info=True)
    line = _strict(stream.getvalue())
    assert "exc_info" not in line
    assert line["exception"].startswith("Traceback") and f"ValueError: {message}" in line["exception"]


def test_json_lines_keep_non_ascii_readable():
    telemetry.configure(log_format="json", log_stream=(stream := io.StringIO()))
    name = f"Gerät-{random.randint(0, 999)} ✓"
    telemetry.get_logger("ops20").warning("déjà vu", device=name)
    line = _strict(stream.getvalue())
    assert (line["event"], line["device"]) == ("déjà vu", name)
