"""An ML platform's operations: settings and caches in containers and shared hosts."""

from __future__ import annotations

import errno
import io
import json
import os
import pwd
import random
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.core._tuning_worker import CODE, key
from tests.core.adapters import FakeAdapter, fake_caps
from torchhal.hal_core import profile, settings, telemetry
from torchhal.hal_core.device import Device
from torchhal.hal_core.errors import ConfigurationError
from torchhal.hal_core.settings import Settings
from torchhal.hal_core.tuning import Tuner


def _delta(before: dict[str, int], name: str) -> int:
    return telemetry.counts().get(name, 0) - before.get(name, 0)


@pytest.fixture
def homeless(monkeypatch):
    """A container's user: HOME unset and a user id the password database lacks."""
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)


@pytest.mark.skipif(sys.platform == "win32", reason="the password database is POSIX's")
def test_without_a_home_the_cache_goes_to_the_temp_dir_logged_and_counted(homeless, monkeypatch):
    """Settings' default cache dir raised RuntimeError (Could not determine home directory): every
    HAL and every log line of such a container failed."""
    monkeypatch.setattr(settings, "_warned_no_home", False, raising=False)
    monkeypatch.setattr(settings, "_temp_dir", None)
    telemetry.configure(log_format="json", log_stream=(stream := io.StringIO()))
    before = telemetry.counts()
    first, second = Settings.from_env({}), Settings.from_env({})
    expected = Path(tempfile.gettempdir()) / f"torchhal-{os.getuid()}"
    assert first.cache_dir == second.cache_dir == expected
    assert _delta(before, "torchhal.cache.no_home") == 1  # said once
    (line,) = [json.loads(raw) for raw in stream.getvalue().splitlines()]
    assert "TORCHHAL_CACHE_DIR" in line["event"] and line["using"] == str(expected)
    assert "RuntimeError" in line["error"]


@pytest.mark.skipif(sys.platform == "win32", reason="the password database is POSIX's")
def test_a_temp_cache_dir_others_may_write_is_not_used(homeless, monkeypatch, tmp_path):
    """`<tempdir>/torchhal-<uid>` made beforehand by someone else, or writable by others, could
    feed this process kernel winners: a private directory instead, warned and counted."""
    monkeypatch.setattr(settings, "_temp_dir", None)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    planted = tmp_path / f"torchhal-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    telemetry.configure(log_format="json", log_stream=(stream := io.StringIO()))
    before = telemetry.counts()
    chosen = Settings.from_env({}).cache_dir
    assert chosen != planted and chosen.parent == tmp_path and chosen.stat().st_mode & 0o077 == 0
    assert Settings.from_env({}).cache_dir == chosen  # once per process
    assert _delta(before, "torchhal.cache.untrusted_temp_dir") == 1
    assert any("not this user's alone" in json.loads(raw)["event"] for raw in stream.getvalue().splitlines())


@pytest.mark.skipif(sys.platform == "win32", reason="the password database is POSIX's")
def test_a_tilde_that_cannot_be_expanded_names_the_setting(homeless):
    """`TORCHHAL_CACHE_DIR=~/cache` without a home raised a bare RuntimeError naming no setting."""
    value = f"~/cache{random.randint(0, 999)}"
    with pytest.raises(ConfigurationError, match=rf"TORCHHAL_CACHE_DIR='{value}'.*'~' cannot be expanded"):
        Settings.from_env({"TORCHHAL_CACHE_DIR": value})


def test_a_relative_home_gives_an_absolute_cache_dir(tmp_path, monkeypatch):
    """The default cache dir stayed relative under a relative HOME (TORCHHAL_CACHE_DIR was made
    absolute, the default was not), so a process that changed directory wrote somewhere new."""
    home = f"rel{random.randint(0, 999)}/home"
    monkeypatch.setenv("HOME", home)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    made = Settings.from_env({})
    monkeypatch.chdir(tmp_path.parent)
    assert made.cache_dir == tmp_path / home / ".cache" / "torchhal"


@pytest.fixture
def denied(tmp_path, monkeypatch):
    """A directory of another user's (mode 0700): stat and open of anything in it are refused,
    as they are without CAP_DAC_OVERRIDE (the tests may run as root, where chmod refuses nothing)."""
    locked = tmp_path / "theirs"

    def refuse(real):
        def call(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path).is_relative_to(locked):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "stat", refuse(os.stat))
    monkeypatch.setattr(os, "open", refuse(os.open))
    monkeypatch.setattr(io, "open", refuse(io.open))
    return locked


def test_an_unreadable_selection_cache_is_a_counted_miss_not_a_crash(denied):
    """`path.exists()` raised PermissionError out of the first call of an op on a tuned device."""
    telemetry.configure(log_format="json", log_stream=(stream := io.StringIO()))
    before = telemetry.counts()
    device = Device(FakeAdapter(), fake_caps())
    tuner = Tuner(denied, "on", code=lambda: CODE)
    assert tuner.recall(device, "rms_norm", (0, 1), ["test/w0", "torchhal/aten"]) is None
    tuner.remember(device, "rms_norm", (0, 1), "test/w0", ["test/w0", "torchhal/aten"])
    # the winner is kept in this process, the file not written: both said and counted
    assert tuner.recall(device, "rms_norm", (0, 1), ["torchhal/aten", "test/w0"]) == "test/w0"
    assert _delta(before, "torchhal.cache.unusable") == 1
    assert _delta(before, "torchhal.cache.write_failures") == 1
    events = [json.loads(raw)["event"] for raw in stream.getvalue().splitlines()]
    assert "cached kernel selections unusable; measuring again" in events


def test_an_unreadable_profile_cache_is_a_counted_miss_not_a_crash(denied):
    telemetry.configure(log_format="json", log_stream=(stream := io.StringIO()))
    before = telemetry.counts()
    device = Device(FakeAdapter(), fake_caps())
    assert profile._load_cached(device, profile.cache_path(denied, device)) is None
    assert _delta(before, "torchhal.cache.unusable") == 1
    (line,) = [json.loads(raw) for raw in stream.getvalue().splitlines()]
    assert line["event"] == "cached profile unusable; measuring again" and "PermissionError" in line["reason"]


def test_a_missing_cache_file_is_a_silent_miss(tmp_path):
    """No file is the ordinary first run: nothing said, nothing counted."""
    telemetry.configure(log_level="debug", log_stream=(stream := io.StringIO()))
    before = telemetry.counts()
    device = Device(FakeAdapter(), fake_caps())
    assert profile._load_cached(device, profile.cache_path(tmp_path, device)) is None
    assert Tuner(tmp_path, "on", code=lambda: CODE).recall(device, "rms_norm", (0,), ["a", "b"]) is None
    assert stream.getvalue() == "" and _delta(before, "torchhal.cache.unusable") == 0


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_cache_files_are_readable_as_the_umask_says(tmp_path):
    """mkstemp made every cache file 0600 whatever the umask: in a cache shared by a group
    (umask 002), each user's files were unreadable to the others, measured again and replaced."""
    umask = random.choice([0o002, 0o022, 0o027])
    old = os.umask(umask)
    try:
        device = Device(FakeAdapter(), fake_caps())
        Tuner(tmp_path, "on", code=lambda: CODE).remember(device, "rms_norm", (0, 0), "test/w0", ["test/w0"])
        assert profile.write_cached(tmp_path / "profiles" / "p.json", "{}")
    finally:
        os.umask(old)
    for path in [*(tmp_path / "selections").glob("*.json"), tmp_path / "profiles" / "p.json"]:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path


def test_cache_files_are_utf8_in_an_ascii_locale(tmp_path):
    """Written in the locale's encoding: under LC_ALL=C without UTF-8 mode a device name such as
    'Xeon®' raised UnicodeEncodeError out of the profile (a ValueError, not a cache OSError)."""
    path = tmp_path / "profiles" / "p.json"
    text = json.dumps({"name": f"Xeon® {random.randint(0, 999)} ✓"}, ensure_ascii=False)
    script = textwrap.dedent(f"""
        import locale, sys
        from pathlib import Path
        from torchhal.hal_core.profile import write_cached
        encoding = locale.getpreferredencoding(False)
        assert encoding.lower() in ("ansi_x3.4-1968", "ascii"), encoding  # the locale this is about
        sys.exit(0 if write_cached(Path({str(path)!r}), {text!a}) else 3)
    """)
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert path.read_bytes() == text.encode("utf-8")


def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """ENOSPC while a winner is written: logged and counted, the file as it was, no temporary."""
    device = Device(FakeAdapter(), fake_caps())
    Tuner(tmp_path, "on", code=lambda: CODE).remember(device, "rms_norm", (0, 0), "test/w0", ["test/w0"])
    (path,) = (tmp_path / "selections").glob("*.json")
    kept = path.read_bytes()

    def full(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    before = telemetry.counts()
    Tuner(tmp_path, "on", code=lambda: CODE).remember(device, "rms_norm", (0, 1), "test/w0", ["test/w0"])
    assert _delta(before, "torchhal.cache.write_failures") == 1
    assert path.read_bytes() == kept and set(json.loads(kept)["winners"]) == {key(0, 0)}
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, path.name + ".lock"])
