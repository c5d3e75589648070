"""In-process end-to-end scenarios (tests/support/inproc.py): the broker's and the workers' real
cores and executors on one event loop, every message through the real codec, the real SDK on
top; no process, no socket. What needs real processes stays in tests/mesh/."""

from __future__ import annotations

from tests.support.inproc import inproc_mesh

__all__ = ["inproc_mesh"]  # the `mesh` fixture of tests/scenarios/
