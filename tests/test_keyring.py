"""The broker's key ring (`flowmesh.auth.KeyRing`) reads the key directory again whenever a key
file changes, not only when the directory's own time does: a key written in place, or made
within one tick of the directory's clock after the ring last read it, is let in. (CURVE end to
end: tests/mesh/test_auth.py.)"""

from __future__ import annotations

import os
from pathlib import Path

from flowmesh.auth import KeyRing, add_key, init_keys


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
