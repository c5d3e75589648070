"""What the broker has promised, kept on disk: an embedded SQLite database (WAL mode).

With `--state-dir DIR` the broker writes to `DIR/broker.sqlite3`, before it answers the call that
made the promise:

- **models**: a deployed model's spec, its plan (and the partitioner's inputs, the device bytes of
  each stage), the replicas it wants, and its placement (which worker hosts which stage of each
  replica). Written when the deploy is answered, rewritten when the placement changes, deleted
  when the model is undeployed.
- **jobs**: a training job's spec, configuration, batch size and worker (a pipelined job's: its
  stages' workers, in stage order), and its last checkpoint (path and step) when one was saved.
  Written when the open is answered, rewritten on each save, deleted when the job is closed or
  lost.
- **meta**: the allow-list in force, and a boot counter (`next_epoch`): each start of the broker
  takes the next number, and numbers its calls above `epoch << 40`, so that a late answer to a
  call of a previous life can never be taken for an answer to one of this life.

A plain class over the standard library's `sqlite3`: no threads, no ORM. Values are stored as
msgpack (what the wire carries), so a spec reads back exactly as it was written. Writes commit
at once (`synchronous=FULL`): a SIGKILL, or a power cut, after a call was answered never loses
what the answer promised. Tests drive it in-process with a temporary directory.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

FILE = "broker.sqlite3"
LOCK = "broker.lock"  # held (flock) by the broker using the directory; the kernel drops it at exit
SCHEMA_VERSION = 3

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY,
    spec BLOB NOT NULL,
    plan BLOB NOT NULL,
    inputs BLOB NOT NULL,
    stage_bytes BLOB NOT NULL,
    desired_replicas INTEGER NOT NULL,
    placement BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    spec BLOB NOT NULL,
    config BLOB NOT NULL,
    batch INTEGER NOT NULL,
    worker TEXT NOT NULL,
    saved_step INTEGER,
    saved_path TEXT,
    pipeline BLOB,
    idle_close_s REAL
);
"""
# What takes a directory written by an older broker to this schema, by the version it was at.
_MIGRATIONS = {
    1: "ALTER TABLE jobs ADD COLUMN pipeline BLOB",  # pipelined jobs kept from version 2 on
    2: "ALTER TABLE jobs ADD COLUMN idle_close_s REAL",  # jobs closed when idle, from 3 on
}


def _migrate(db: sqlite3.Connection, version: int) -> None:
    """Take a database at `version` to `SCHEMA_VERSION`, one step at a time, in one
    transaction: a broker killed meanwhile leaves it as it was."""
    db.execute("BEGIN IMMEDIATE")
    try:
        while version != SCHEMA_VERSION:
            db.execute(_MIGRATIONS[version])
            version += 1
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (_pack(version),))
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _unpack(blob: bytes) -> Any:
    return msgpack.unpackb(blob, raw=False, strict_map_key=False)


@dataclass
class ModelRecord:
    """A deployed model as the store keeps it (plain data)."""

    name: str
    spec: dict[str, Any]
    plan: dict[str, Any]
    inputs: dict[str, Any] | None
    stage_bytes: list[int]
    desired_replicas: int
    # One list per replica: placement[r][i] is the worker holding stage i of replica r.
    placement: list[list[str]] = field(default_factory=list)


@dataclass
class JobRecord:
    """A training job as the store keeps it (plain data)."""

    name: str
    spec: dict[str, Any]
    config: dict[str, Any]
    batch: int
    worker: str
    saved_step: int | None = None
    saved_path: str | None = None
    # A pipelined job's stages' workers in stage order (`worker` is stage 0's); empty: one.
    workers: list[str] = field(default_factory=list)
    # Closed by the broker after this many seconds without a call naming it (None: never).
    idle_close_s: float | None = None


@dataclass
class Snapshot:
    """Everything `load_all` read back."""

    models: dict[str, ModelRecord]
    jobs: dict[str, JobRecord]
    allow: tuple[str, ...] | None  # None: never recorded


class Store:
    """`Store(dir).open()`; every save commits before it returns."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory).expanduser()
        self.path = self.dir / FILE
        self.db: sqlite3.Connection | None = None
        self._lock: int | None = None

    def open(self, lock: bool = False) -> Store:
        """Open (creating) the database. `lock`: also take the directory for this process
        alone, so that a second broker started on it by mistake stops with a clear error
        instead of writing beside the first; a killed broker's lock goes with it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if lock:
            fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise OSError(
                    f"{self.dir}: another broker uses this state directory (it holds {LOCK})"
                ) from None
            self._lock = fd
        # Autocommit (isolation_level None): each statement is its own transaction, or the
        # explicit BEGIN ... COMMIT of `_write`.
        db = sqlite3.connect(self.path, isolation_level=None, timeout=10.0)
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            db.close()
            self.close()  # the lock too
            raise OSError(f"{self.path}: SQLite would not use WAL mode (got {mode!r})")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
        if row is None:
            # New, or made by a version-1 broker killed before it stamped it (its jobs table,
            # which CREATE ... IF NOT EXISTS left as it was, has no pipeline column).
            columns = {c[1] for c in db.execute("PRAGMA table_info(jobs)")}
            version = 3 if "idle_close_s" in columns else 2 if "pipeline" in columns else 1
            db.execute("INSERT INTO meta VALUES ('schema', ?)", (_pack(version),))
            row = (_pack(version),)
        if _unpack(row[0]) in _MIGRATIONS:
            try:
                _migrate(db, _unpack(row[0]))
            except BaseException:
                db.close()
                self.close()  # the lock too
                raise
        elif _unpack(row[0]) != SCHEMA_VERSION:
            db.close()
            self.close()  # the lock too
            raise OSError(
                f"{self.path}: state schema {_unpack(row[0])!r}, this broker reads "
                f"{SCHEMA_VERSION}; move the state directory aside"
            )
        self.db = db
        return self

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None
        if self._lock is not None:
            os.close(self._lock)  # and with it the lock
            self._lock = None

    def _conn(self) -> sqlite3.Connection:
        if self.db is None:
            raise OSError(f"{self.path}: the store is not open")
        return self.db

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(sql, args)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # ------------------------------------------------------------------ models

    def save_model(self, rec: ModelRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO models VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                rec.name,
                _pack(rec.spec),
                _pack(rec.plan),
                _pack(rec.inputs),
                _pack(list(rec.stage_bytes)),
                int(rec.desired_replicas),
                _pack([list(ws) for ws in rec.placement]),
            ),
        )

    def drop_model(self, name: str) -> None:
        self._write("DELETE FROM models WHERE name = ?", (name,))

    # ------------------------------------------------------------------ jobs

    def save_job(self, rec: JobRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO jobs (name, spec, config, batch, worker, saved_step, "
            "saved_path, pipeline, idle_close_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                rec.name,
                _pack(rec.spec),
                _pack(rec.config),
                int(rec.batch),
                rec.worker,
                rec.saved_step,
                rec.saved_path,
                _pack(list(rec.workers)) if rec.workers else None,
                rec.idle_close_s,
            ),
        )

    def drop_job(self, name: str) -> None:
        self._write("DELETE FROM jobs WHERE name = ?", (name,))

    # ------------------------------------------------------------------ meta

    def save_allow(self, allow: tuple[str, ...]) -> None:
        self._write("INSERT OR REPLACE INTO meta VALUES ('allow', ?)", (_pack(list(allow)),))

    def next_epoch(self) -> int:
        """This start's number (1, 2, ...): one more than the last start's."""
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            row = db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
            epoch = (_unpack(row[0]) if row else 0) + 1
            db.execute("INSERT OR REPLACE INTO meta VALUES ('epoch', ?)", (_pack(epoch),))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return int(epoch)

    # ------------------------------------------------------------------ reading back

    def load_all(self) -> Snapshot:
        db = self._conn()
        models = {
            name: ModelRecord(
                name=name,
                spec=_unpack(spec),
                plan=_unpack(plan),
                inputs=_unpack(inputs),
                stage_bytes=list(_unpack(stage_bytes)),
                desired_replicas=int(desired),
                placement=[list(ws) for ws in _unpack(placement)],
            )
            for name, spec, plan, inputs, stage_bytes, desired, placement in db.execute(
                "SELECT * FROM models ORDER BY name"
            )
        }
        jobs = {
            name: JobRecord(
                name=name,
                spec=_unpack(spec),
                config=_unpack(config),
                batch=int(batch),
                worker=worker,
                saved_step=saved_step,
                saved_path=saved_path,
                workers=list(_unpack(pipeline)) if pipeline is not None else [],
                idle_close_s=idle,
            )
            for name, spec, config, batch, worker, saved_step, saved_path, pipeline, idle in (
                db.execute(
                    "SELECT name, spec, config, batch, worker, saved_step, saved_path, pipeline, "
                    "idle_close_s FROM jobs ORDER BY name"
                )
            )
        }
        row = db.execute("SELECT value FROM meta WHERE key = 'allow'").fetchone()
        allow = tuple(_unpack(row[0])) if row else None
        return Snapshot(models=models, jobs=jobs, allow=allow)
