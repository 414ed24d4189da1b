"""SampleStore: finished samples on disk, so an interrupted experiment resumes instead of re-measuring.

One sqlite row per finished sample, committed as soon as it is measured. The file runs in WAL
mode with `synchronous=NORMAL`: a committed row survives the process being killed (it is in
the OS's buffers and the WAL), though not a power cut; several processes (ranks of a sharded
evaluation on one host) may open and write the same file, each waiting up to `timeout_s` for the lock.
Rows are keyed by (experiment, variant, key): `experiment` is a hash of everything that makes
samples comparable (configuration and environment), `key` is a round number or an input hash.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torchhal.hal_core import ConfigurationError, telemetry

log = telemetry.get_logger("torchhal.evaluation.store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    experiment TEXT NOT NULL,
    variant TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    session TEXT NOT NULL,
    written_at REAL NOT NULL,
    PRIMARY KEY (experiment, variant, key)
);
CREATE TABLE IF NOT EXISTS experiments (
    experiment TEXT PRIMARY KEY,
    config TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""
_COLUMNS = {
    "samples": ["experiment", "variant", "key", "value", "session", "written_at"],
    "experiments": ["experiment", "config", "created_at"],
}


class SampleStore:
    """Finished samples of experiments in one sqlite file. `session` tags the rows this process wrote."""

    def __init__(self, path: str | Path, *, timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self.session = uuid.uuid4().hex[:12]
        if not self.path.parent.exists():
            raise ConfigurationError(f"sample store {self.path}: directory {self.path.parent} does not exist")
        self._db, mode = _open_waiting(self.path, timeout_s)
        if str(mode).lower() != "wal":
            log.warning("sample store not in WAL mode", path=str(self.path), mode=mode)

    def register(self, experiment: str, config: Mapping[str, Any]) -> None:
        """Record what an experiment key stands for (kept from its first run)."""
        self._db.execute(
            "INSERT OR IGNORE INTO experiments VALUES (?, ?, ?)",
            (experiment, json.dumps(config, sort_keys=True, default=str), time.time()),
        )

    def put(self, experiment: str, variant: str, key: str, value: Mapping[str, Any]) -> None:
        """Write one finished sample now (its own transaction)."""
        self.put_many(experiment, [(variant, key, value)])

    def put_many(self, experiment: str, rows: Iterable[tuple[str, str, Mapping[str, Any]]]) -> None:
        """Write finished samples in one transaction; a row with the same key is replaced."""
        now = time.time()
        data = [(experiment, v, k, json.dumps(value), self.session, now) for v, k, value in rows]
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("INSERT OR REPLACE INTO samples VALUES (?, ?, ?, ?, ?, ?)", data)

    def get(self, experiment: str, variant: str, key: str) -> dict[str, Any] | None:
        row = self._db.execute(
            "SELECT value FROM samples WHERE experiment = ? AND variant = ? AND key = ?",
            (experiment, variant, key),
        ).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def load(self, experiment: str) -> dict[tuple[str, str], dict[str, Any]]:
        """Every finished sample of `experiment`, by (variant, key)."""
        rows = self._db.execute(
            "SELECT variant, key, value FROM samples WHERE experiment = ?", (experiment,)
        ).fetchall()
        return {(variant, key): dict(json.loads(value)) for variant, key, value in rows}

    def count(self, experiment: str) -> int:
        return int(
            self._db.execute("SELECT COUNT(*) FROM samples WHERE experiment = ?", (experiment,)).fetchone()[0]
        )

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> SampleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_waiting(path: Path, timeout_s: float) -> tuple[sqlite3.Connection, str]:
    """`_open`, tried again while another process holds the new file's lock, for up to `timeout_s`.

    Two processes opening a new file at once both read it, then both ask to write (the WAL
    switch, the schema): sqlite answers one "database is locked" at once, without waiting out its
    busy timeout, since waiting would deadlock. Its turn comes when the other has finished."""
    deadline = time.monotonic() + timeout_s
    pause_s = 0.005
    while True:
        try:
            return _open(path, timeout_s)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + pause_s > deadline:
                raise _unusable(path, exc) from exc
            log.debug("sample store locked while opening; trying again", path=str(path), pause_s=pause_s)
        except sqlite3.DatabaseError as exc:
            raise _unusable(path, exc) from exc
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, 0.5)


def _unusable(path: Path, exc: Exception) -> ConfigurationError:
    return ConfigurationError(f"sample store {path}: not a usable sqlite file: {exc}")


def _open(path: Path, timeout_s: float) -> tuple[sqlite3.Connection, str]:
    """A connection to `path` in WAL mode with the schema in place, and the journal mode it got."""
    db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None)
    try:
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        _check_file(db, path)
    except BaseException:
        db.close()
        raise
    return db, str(mode)


def _check_file(db: sqlite3.Connection, path: Path) -> None:
    """Refuse, before anything is measured, a file whose tables another program or another
    version made (CREATE TABLE IF NOT EXISTS keeps them; the first write would fail) or whose
    pages are damaged (reads would fail part-way through a resume)."""
    for table, expected in _COLUMNS.items():
        found = [row[1] for row in db.execute(f"PRAGMA table_info({table})")]
        if found != expected:
            raise ConfigurationError(
                f"sample store {path}: table {table!r} has columns {found}, expected {expected}: "
                "the file was made by another program or another version; use another file"
            )
    problems = [row[0] for row in db.execute("PRAGMA quick_check(5)")]
    if problems != ["ok"]:
        raise ConfigurationError(f"sample store {path}: the file is damaged: {'; '.join(problems)}")
