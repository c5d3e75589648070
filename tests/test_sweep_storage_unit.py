"""`client_sdk.sweep.open_storage`: the URL schemes a shared sweep takes, and the clear error of a
bad URL or an unreachable database (in seconds, not a hang). The drivers sharing a study over a
mesh are tests/mesh/test_sweep_storage.py."""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path

import optuna
import pytest

from client_sdk.sweep import _finished, open_storage


def test_sqlite_and_journal_urls_open_a_shared_study(tmp_path: Path) -> None:
    for url in (f"sqlite:///{tmp_path / 's.db'}", f"journal:{tmp_path / 's.log'}"):
        a = optuna.create_study(storage=open_storage(url), study_name="s", load_if_exists=True)
        a.enqueue_trial({"x": 1.0})
        b = optuna.create_study(storage=open_storage(url), study_name="s", load_if_exists=True)
        assert [t.system_attrs["fixed_params"] for t in b.get_trials()] == [{"x": 1.0}], url


def test_a_bad_url_or_an_unreachable_server_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not an SQLAlchemy URL"):
        open_storage("no-such-scheme")
    pytest.importorskip("psycopg")
    with socket.socket() as s:  # a port nothing listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"127.0.0.1.*{port}|{port}.*refused|refused"):
        open_storage(f"postgresql+psycopg://u@127.0.0.1:{port}/db")


def test_a_retried_trial_counts_once(tmp_path: Path) -> None:
    storage = open_storage(f"sqlite:///{tmp_path / 's.db'}", heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(storage=storage, study_name="s")
    dead = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    storage.record_heartbeat(dead._trial_id)  # type: ignore[attr-defined]
    # Its driver went quiet an hour ago, far past the grace period: as good as dead. (Written
    # into the database itself, whose clock Optuna reads, rather than waited for.)
    with sqlite3.connect(tmp_path / "s.db") as db:
        db.execute("UPDATE trial_heartbeats SET heartbeat = datetime('now', '-1 hour')")
    optuna.storages.fail_stale_trials(study)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "WAITING"]
    assert _finished(trials) == 0  # the failed trial lives on as its retry
    study.tell(study.ask(), 0.5)
    assert _finished(study.get_trials()) == 1


def test_a_grace_period_within_the_heartbeat_interval_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    with pytest.raises(ValueError, match="grace period of 5 s is no longer than the heartbeat"):
        open_storage(url, heartbeat_interval=5, grace_period=5)
    open_storage(url, heartbeat_interval=5, grace_period=6)  # and the next second is enough
