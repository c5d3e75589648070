"""The wire protocol, in one name: `from flowmesh import protocol as p`, then `p.Deploy`,
`p.encode`, `p.decode`, ...

The messages are declared in `flowmesh.messages` (one `msgspec.Struct` each, which is also the
schema checked on receipt); framing, tensors, limits, bundles and errors are `flowmesh.codec`.
"""

from __future__ import annotations

from flowmesh import messages
from flowmesh.codec import (
    BUNDLE_BYTES,
    DEFAULT_LIMITS,
    MAX_BUNDLE,
    DecodeError,
    Limits,
    TensorRef,
    bundled,
    decode,
    decode_member,
    encode,
    error_for,
    tensor_frame,
)
from flowmesh.messages import *  # noqa: F403 (every message type and its parts' types)

__all__ = [
    *messages.__all__,
    "BUNDLE_BYTES",
    "DEFAULT_LIMITS",
    "MAX_BUNDLE",
    "DecodeError",
    "Limits",
    "TensorRef",
    "bundled",
    "decode",
    "decode_member",
    "encode",
    "error_for",
    "tensor_frame",
]
