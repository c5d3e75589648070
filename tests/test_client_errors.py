"""The SDK's exception for each code a call can fail with: every code the broker answers a
client with has a class of its own kind, not InternalError."""

from __future__ import annotations

from client_sdk import errors
from flowmesh.errors import Code

# Codes that stay between broker and workers, never a client's answer (NOT_RESIDENT is retried
# by the broker, NAME_TAKEN refuses a peer's registration), and INTERNAL itself.
PEER_ONLY = {Code.NOT_RESIDENT, Code.NAME_TAKEN, Code.INTERNAL}


def test_every_client_facing_code_has_its_exception() -> None:
    for code in Code:
        got = errors.error_from(code.value, "why")
        assert got.code == code and got.reason == "why"
        if code not in PEER_ONLY:
            assert not isinstance(got, errors.InternalError), code


def test_no_space_is_full_for_now_retry_later() -> None:
    assert isinstance(errors.error_from("no_space", "KV held"), errors.Overloaded)
