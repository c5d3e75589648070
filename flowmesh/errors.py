"""Error codes shared by every process, and the one exception type that carries them."""

from __future__ import annotations

from enum import StrEnum


class Code(StrEnum):
    # malformed traffic (answered, never fatal)
    BAD_MESSAGE = "bad_message"  # not msgpack, truncated, wrong field types
    BAD_FRAMES = "bad_frames"  # frame count does not match the header
    BAD_TENSOR = "bad_tensor"  # bytes do not match dtype x shape, unknown dtype
    UNKNOWN_TYPE = "unknown_type"
    TOO_LARGE = "too_large"
    VERSION = "version_mismatch"
    # requests
    BAD_REQUEST = "bad_request"
    NOT_ALLOWED = "not_allowed"
    UNAUTHORIZED = "unauthorized"  # no key the broker knows (CURVE on)
    FORBIDDEN = "forbidden"  # a known key whose role or name does not grant the call
    NAME_TAKEN = "name_taken"  # a live peer of another process holds the name registered
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_EXISTS = "model_exists"
    TOO_BIG = "too_big"  # cannot fit the devices, whatever is evicted
    UNAVAILABLE = "unavailable"  # no worker / partitioner able to take it now
    OVERLOADED = "overloaded"  # queue or socket high-water mark reached
    TIMEOUT = "timeout"
    WORKER_LOST = "worker_lost"
    MODEL_ERROR = "model_error"  # the model's own code raised
    NO_SPACE = "no_space"  # a worker could not place a load (fragmentation)
    NOT_RESIDENT = "not_resident"
    # A Generate's prompts were encoded with a tokenizer its model no longer has (deployed
    # again under that name): the client fetches the new one and encodes again.
    TOKENIZER_CHANGED = "tokenizer_changed"
    NOT_A_CHAIN = "not_a_chain"
    PLAN_ERROR = "plan_error"
    DEPLOY_FAILED = "deploy_failed"
    IO_ERROR = "io_error"  # reading or writing a file failed: the path and the errno's text
    INTERNAL = "internal"


class FlowmeshError(Exception):
    """An error with a wire code and a readable reason."""

    def __init__(self, code: Code | str, reason: str) -> None:
        super().__init__(f"[{code}] {reason}")
        self.code = Code(code) if code in Code._value2member_map_ else code
        self.reason = reason


def bad_request(reason: str) -> FlowmeshError:
    """A request refused for what it asks (BAD_REQUEST): `raise bad_request("...")`."""
    return FlowmeshError(Code.BAD_REQUEST, reason)


class Invalid(FlowmeshError, ValueError):
    """A FlowmeshError raised by a declared payload checking itself (its `__post_init__`): a
    ValueError as well, so that msgspec, decoding a message, reports it with the field's path,
    and `flowmesh.codec` answers it with this code and reason."""
