"""The broker's key ring (`flowmesh.auth.KeyRing`) reads the key directory again whenever a key
file changes, not only when the directory's own time does: a key written in place, or made
within one tick of the directory's clock after the ring last read it, is let in. (CURVE end to
end: tests/mesh/test_auth.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowmesh.auth import KeyRing, add_key, init_keys, read_api_keys


def test_a_key_changed_in_place_is_read_again(tmp_path: Path) -> None:
    keys = init_keys(tmp_path / "keys")
    add_key(keys, "worker-0", "worker")
    ring = KeyRing(keys)
    assert sorted(i.name for i in ring.by_key.values()) == ["worker-0"]
    # A public file that had no role yet when the ring read it (skipped), its role written in
    # place afterwards; the directory's time as it was when the ring read it.
    public = keys / "worker-0.key"
    text = public.read_text()
    before = os.stat(keys)
    public.write_text(text.replace('role = "worker"', 'role = ""'))
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
    ring.refresh()
    assert ring.by_key == {}
    public.write_text(text)
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
    ring.refresh()
    assert sorted(i.name for i in ring.by_key.values()) == ["worker-0"]


def test_a_key_made_in_the_same_tick_of_the_directorys_clock_is_read(tmp_path: Path) -> None:
    keys = init_keys(tmp_path / "keys")
    ring = KeyRing(keys)
    before = os.stat(keys)
    add_key(keys, "worker-1", "worker")
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))  # a clock that did not move
    ring.refresh()
    assert sorted(i.name for i in ring.by_key.values()) == ["worker-1"]
    assert not [p for p in keys.iterdir() if p.name.startswith(".")]  # no staging left


def test_keys_list_shows_api_keys_and_keys_remove_revokes_either_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from client_sdk import cli

    keys = tmp_path / "keys"
    assert cli.main(["keys", "add", "web", "--role", "client", "--api", "--dir", str(keys)]) == 0
    capsys.readouterr()
    # API keys alone (no broker key): listed, where this used to fail on broker.key_secret.
    assert cli.main(["keys", "list", str(keys)]) == 0
    assert capsys.readouterr().out.splitlines()[2].split() == ["web", "client", "api"]
    init_keys(keys)
    add_key(keys, "worker-0", "worker")
    ring = KeyRing(keys)
    assert cli.main(["keys", "list", str(keys)]) == 0
    listed = capsys.readouterr().out.splitlines()[2:]
    assert [line.split() for line in listed] == [
        ["web", "client", "api"],
        ["worker-0", "worker", "curve"],
    ]
    assert cli.main(["keys", "remove", "worker-0", "--dir", str(keys)]) == 0
    assert not (keys / "worker-0.key").exists() and not (keys / "worker-0.key_secret").exists()
    ring.refresh()
    assert ring.by_key == {}  # a running broker's ring refuses it from now on
    assert cli.main(["keys", "remove", "web", "--api", "--dir", str(keys)]) == 0
    assert read_api_keys(keys / "api_keys.json") == {}
    capsys.readouterr()
    # The broker's own key, and names not there, are refused.
    assert cli.main(["keys", "remove", "broker", "--dir", str(keys)]) == 1
    assert cli.main(["keys", "remove", "web", "--api", "--dir", str(keys)]) == 1
    assert "holds no API key named 'web'" in capsys.readouterr().err
    assert (keys / "broker.key").exists() and (keys / "broker.key_secret").exists()
