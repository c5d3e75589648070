"""Real meshes for end-to-end tests: broker, partitioner and workers as processes on loopback.

`FLOWMESH_TEST_KEYS=1` runs them with CURVE keys on: every `LocalMesh` of the session (the shared
fixtures' and those tests build) takes one session key directory, and plain SDK clients its
operator key (FLOWMESH_KEYS). Tests whose premise is a raw socket without a key are skipped then.
The fixtures and helpers live in tests/support/mesh.py (test modules import them from there);
this file registers the fixtures for tests/mesh/, marks its tests `slow` (real processes:
`pytest -m "not slow"` runs the in-process tiers alone) and skips what keys make moot.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.mesh import TEST_KEYS, _test_keys, mesh

__all__ = ["_test_keys", "mesh"]  # fixtures registered for tests/mesh/

# Tests built on a raw socket with no key (claiming a routing id, forging a peer): with keys on,
# the broker refuses that socket before anything the test checks can happen.
KEYLESS_PREMISE = {
    "test_without_keys_no_forged_answer_reaches_a_client",
    # These speak raw, keyless DEALER sockets at the broker's ports (malformed messages, forged
    # peers, a flood): with keys on their messages never reach the broker's logic at all.
    "test_malformed_messages_are_answered_while_a_client_keeps_working",
    "test_an_impostor_cannot_answer_runs_it_was_not_sent_or_break_status",
    "test_fuzz_at_both_ports_while_a_healthy_client_is_served",
    "test_a_flood_leaves_the_mesh_standing",
}


HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees the whole session's items: only those under tests/mesh/ are ours.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)
    if not TEST_KEYS:
        return
    skip = pytest.mark.skip(reason="a raw socket without a key: FLOWMESH_TEST_KEYS=1 refuses it")
    for item in items:
        if getattr(item, "originalname", item.name) in KEYLESS_PREMISE:
            item.add_marker(skip)
