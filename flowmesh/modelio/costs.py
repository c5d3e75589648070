"""What profiling learns about a model, as plain data: no torch, so the broker can read it.

`flowmesh.modelio.profile` fills these; planners and plans read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from flowmesh.errors import Code, FlowmeshError


def _bad(reason: str) -> FlowmeshError:
    return FlowmeshError(Code.PLAN_ERROR, f"bad profile: {reason}")


def _nonneg_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _opt_seconds(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"{what} must be a finite number of seconds or null, got {value!r}")
    if value < 0:
        raise _bad(f"{what} must not be negative, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class BlockProfile:
    """One block of the chain.

    Bytes count each tensor once over the whole model: `param_bytes`/`buffer_bytes` are the
    tensors this block is the first to hold; `shared_bytes` are tensors it holds that an earlier
    block already counted (tied weights, e.g. GPT-2's lm_head is wte). A stage holding this block
    without the earlier one must still hold the shared tensors, so memory checks add them.
    """

    name: str
    param_bytes: int
    buffer_bytes: int
    shared_bytes: int = 0
    out_bytes_per_sample: int = 0
    saved_bytes_per_sample: int = 0
    out_shape: tuple[int, ...] | None = None  # at the profiled batch and sequence length
    forward_s: float | None = None
    forward_backward_s: float | None = None
    tensors: tuple[str, ...] = ()  # original state_dict names of every tensor the block holds
    # Buffers the block holds that are not in the state_dict (non-persistent: a causal mask, a
    # rotary cache), made by the module itself: no weights file carries them, but a stage
    # that holds the block holds them too.
    transient_bytes: int = 0

    @property
    def own_bytes(self) -> int:
        return self.param_bytes + self.buffer_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes this block needs in memory on its own (its tensors, shared ones included)."""
        return self.param_bytes + self.buffer_bytes + self.shared_bytes

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["out_shape"] = None if self.out_shape is None else list(self.out_shape)
        out["tensors"] = list(self.tensors)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> BlockProfile:
        if not isinstance(data, dict):
            raise _bad("a block must be a mapping")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise _bad(f"unknown block field(s): {', '.join(sorted(map(str, unknown)))}")
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("a block needs a non-empty name")
        shape = data.get("out_shape")
        if shape is not None and (
            not isinstance(shape, list | tuple)
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
        ):
            raise _bad(f"block {name!r}: out_shape must be a list of sizes")
        tensors = data.get("tensors", ())
        if not isinstance(tensors, list | tuple) or not all(isinstance(t, str) for t in tensors):
            raise _bad(f"block {name!r}: tensors must be a list of names")
        return cls(
            name=name,
            param_bytes=_nonneg_int(data.get("param_bytes"), f"{name}.param_bytes"),
            buffer_bytes=_nonneg_int(data.get("buffer_bytes"), f"{name}.buffer_bytes"),
            shared_bytes=_nonneg_int(data.get("shared_bytes", 0), f"{name}.shared_bytes"),
            out_bytes_per_sample=_nonneg_int(
                data.get("out_bytes_per_sample", 0), f"{name}.out_bytes_per_sample"
            ),
            saved_bytes_per_sample=_nonneg_int(
                data.get("saved_bytes_per_sample", 0), f"{name}.saved_bytes_per_sample"
            ),
            out_shape=None if shape is None else tuple(shape),
            forward_s=_opt_seconds(data.get("forward_s"), f"{name}.forward_s"),
            forward_backward_s=_opt_seconds(
                data.get("forward_backward_s"), f"{name}.forward_backward_s"
            ),
            tensors=tuple(tensors),
            transient_bytes=_nonneg_int(
                data.get("transient_bytes", 0), f"{name}.transient_bytes"
            ),
        )


@dataclass(frozen=True)
class ModelProfile:
    """The chain's blocks in order, with the conditions they were profiled under."""

    spec_digest: str
    blocks: tuple[BlockProfile, ...]
    tensor_bytes: dict[str, int] = field(default_factory=dict)  # original name -> bytes
    batch: int = 1
    seq_len: int = 1  # the size given to free (-1) input dimensions other than the batch
    inputs: dict[str, dict[str, Any]] | None = None  # name -> {"dtype", "shape"} as declared
    device: str | None = None  # where times were measured; None: not measured
    uncut: str | None = None  # why the model is one block (it could not be cut), if it is

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.blocks]

    @property
    def total_param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    @property
    def total_buffer_bytes(self) -> int:
        return sum(b.buffer_bytes for b in self.blocks)

    @property
    def total_bytes(self) -> int:
        return self.total_param_bytes + self.total_buffer_bytes

    @property
    def timed(self) -> bool:
        return bool(self.blocks) and all(b.forward_s is not None for b in self.blocks)

    def range_bytes(self, start: int, stop: int) -> int:
        """Exact bytes of blocks[start:stop]: each tensor once, tied ones included once."""
        names: set[str] = set()
        for block in self.blocks[start:stop]:
            names.update(block.tensors)
        if not self.tensor_bytes:  # a profile without tensor names: best additive estimate
            return sum(b.resident_bytes for b in self.blocks[start:stop])
        return sum(self.tensor_bytes[n] for n in names)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec_digest": self.spec_digest,
            "blocks": [b.to_dict() for b in self.blocks],
            "tensor_bytes": dict(self.tensor_bytes),
            "batch": self.batch,
            "seq_len": self.seq_len,
            "inputs": self.inputs,
            "device": self.device,
            "uncut": self.uncut,
            "total_bytes": self.total_bytes,  # derived; for readers, ignored by from_dict
        }

    @classmethod
    def from_dict(cls, data: Any) -> ModelProfile:
        if not isinstance(data, dict):
            raise _bad("a profile must be a mapping")
        data = {k: v for k, v in data.items() if k != "total_bytes"}
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise _bad(f"unknown profile field(s): {', '.join(sorted(map(str, unknown)))}")
        blocks = data.get("blocks")
        if not isinstance(blocks, list | tuple) or not blocks:
            raise _bad("a profile needs a non-empty list of blocks")
        tensor_bytes = data.get("tensor_bytes", {})
        if not isinstance(tensor_bytes, dict):
            raise _bad("tensor_bytes must map names to byte counts")
        for name, size in tensor_bytes.items():
            if not isinstance(name, str):
                raise _bad("tensor_bytes must map names to byte counts")
            _nonneg_int(size, f"tensor_bytes[{name!r}]")
        parsed = tuple(BlockProfile.from_dict(b) for b in blocks)
        if tensor_bytes:
            missing = [t for b in parsed for t in b.tensors if t not in tensor_bytes]
            if missing:
                raise _bad(f"tensor {missing[0]!r} has no entry in tensor_bytes")
        digest = data.get("spec_digest")
        if not isinstance(digest, str):
            raise _bad("spec_digest must be a string")
        inputs = data.get("inputs")
        if inputs is not None and not isinstance(inputs, dict):
            raise _bad("inputs must be a mapping or null")
        device = data.get("device")
        if device is not None and not isinstance(device, str):
            raise _bad("device must be a string or null")
        uncut = data.get("uncut")
        if uncut is not None and not isinstance(uncut, str):
            raise _bad("uncut must be a string or null")
        batch = _nonneg_int(data.get("batch", 1), "batch")
        seq_len = _nonneg_int(data.get("seq_len", 1), "seq_len")
        if batch < 1 or seq_len < 1:
            raise _bad("batch and seq_len must be at least 1")
        return cls(
            spec_digest=digest,
            blocks=parsed,
            tensor_bytes=dict(tensor_bytes),
            batch=batch,
            seq_len=seq_len,
            inputs=inputs,
            device=device,
            uncut=uncut,
        )


def human_bytes(n: int | float) -> str:
    """1536 -> '1.5 KiB': binary units, one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
