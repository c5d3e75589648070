"""Plans: how a model's chain of blocks is cut into stages (serving) or chunks (training).

A plan is versioned data, declared once (`Plan`, a `msgspec.Struct` that messages carry and
msgspec checks on receipt, its `__post_init__` checking the rest): the broker caches it under the
spec's digest and sends it to workers, which build their stage from it
(`flowmesh.modelio.stages`). `chunk_plan` plans training chunks from a profile without torch,
for the partitioner and for a worker opening a job alike; the partitioner's `stage_plan`
(`partitioner.stage_plans`) builds on the helpers here. `make_chunk_plan`
(`flowmesh.modelio.profile`) profiles the spec first.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec

from flowmesh.errors import Code, FlowmeshError, Invalid
from flowmesh.modelio import planners
from flowmesh.modelio.costs import ModelProfile, human_bytes

PLAN_VERSION = 1
KINDS = ("stages", "chunks", "pipeline")
OBJECTIVES = ("time", "bytes", "footprint")
_set = msgspec.structs.force_setattr  # a frozen plan's fields, normalised as it checks itself


def _bad(reason: str) -> FlowmeshError:
    return FlowmeshError(Code.PLAN_ERROR, f"bad plan: {reason}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(values: Any, what: str, length: int) -> tuple[int, ...]:
    if not isinstance(values, list | tuple) or len(values) != length:
        raise _bad(f"{what} must be a list of {length} integers")
    if not all(_is_int(v) and v >= 0 for v in values):
        raise _bad(f"{what} must hold non-negative integers")
    return tuple(values)


class Plan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Contiguous half-open block ranges, with what each range holds and costs.

    `range_bytes` are exact (each tensor of the range once, tied tensors included), `range_time_s`
    sums the blocks' measured forward times (stages) or forward+backward times (chunks) when
    they were measured, `range_footprint` is the training footprint of a chunk (see
    `planners.chunk_footprints`) or the resident bytes of a pipelined job's stage (kind
    "pipeline": `planners.pipeline_stages`). `objective` says which of them was balanced.
    `request` records what the plan was asked for (stages, mem_cap, target_bytes, batch, ...).
    """

    kind: str
    spec_digest: str
    block_names: tuple[str, ...]
    block_bytes: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    range_bytes: tuple[int, ...]
    objective: str
    range_time_s: tuple[float, ...] | None = None
    range_footprint: tuple[int, ...] | None = None
    request: dict[str, Any] = {}
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        try:
            self._check()
        except FlowmeshError as exc:  # msgspec reports a ValueError with the field's path
            raise Invalid(exc.code, exc.reason) from None

    def _check(self) -> None:
        if self.version != PLAN_VERSION:
            raise FlowmeshError(
                Code.PLAN_ERROR,
                f"plan version {self.version!r} is not supported (this partitioner reads version "
                f"{PLAN_VERSION}); re-plan the model",
            )
        if self.kind not in KINDS:
            raise _bad(f"kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.objective not in OBJECTIVES:
            raise _bad(f"objective {self.objective!r}: expected one of {', '.join(OBJECTIVES)}")
        if not isinstance(self.spec_digest, str) or not self.spec_digest:
            raise _bad("spec_digest must be a non-empty string")
        names = self.block_names
        if not isinstance(names, list | tuple) or not names:
            raise _bad("block_names must be a non-empty list")
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
            raise _bad("block_names must be distinct non-empty strings")
        n = len(names)
        _set(self, "block_names", tuple(names))
        _set(self, "block_bytes", _ints(self.block_bytes, "block_bytes", n))
        _set(self, "ranges", self._checkedranges_of(self.ranges, n))
        parts = len(self.ranges)
        _set(self, "range_bytes", _ints(self.range_bytes, "range_bytes", parts))
        if self.range_footprint is not None:
            _set(self, "range_footprint", _ints(self.range_footprint, "range_footprint", parts))
        if self.range_time_s is not None:
            times = self.range_time_s
            if not isinstance(times, list | tuple) or len(times) != parts:
                raise _bad(f"range_time_s must be a list of {parts} numbers")
            if not all(
                isinstance(t, int | float)
                and not isinstance(t, bool)
                and math.isfinite(t)
                and t >= 0
                for t in times
            ):
                raise _bad("range_time_s must hold non-negative finite numbers")
            _set(self, "range_time_s", tuple(float(t) for t in times))
        if self.objective == "time" and self.range_time_s is None:
            raise _bad("a plan balanced by time needs range_time_s")
        if self.objective == "footprint" and self.range_footprint is None:
            raise _bad("a plan balanced by footprint needs range_footprint")
        if not isinstance(self.request, dict) or not all(isinstance(k, str) for k in self.request):
            raise _bad("request must be a mapping with string keys")

    @staticmethod
    def _checkedranges_of(ranges: Any, n: int) -> tuple[tuple[int, int], ...]:
        if not isinstance(ranges, list | tuple) or not ranges:
            raise _bad("ranges must be a non-empty list of [start, stop] pairs")
        out = []
        expect = 0
        for r in ranges:
            if not isinstance(r, list | tuple) or len(r) != 2 or not all(_is_int(v) for v in r):
                raise _bad(f"range {r!r} is not a [start, stop] pair of integers")
            a, b = r
            if a != expect:
                raise _bad(
                    f"range {[a, b]} starts at block {a}, expected {expect}: ranges must be "
                    "contiguous and start at block 0"
                )
            if b <= a:
                raise _bad(f"range {[a, b]} is empty")
            out.append((a, b))
            expect = b
        if expect != n:
            raise _bad(f"ranges end at block {expect}, but the model has {n} blocks")
        return tuple(out)

    # -- reading -------------------------------------------------------------------------

    @property
    def parts(self) -> int:
        return len(self.ranges)

    def objective_values(self) -> tuple[float, ...]:
        if self.objective == "time":
            assert self.range_time_s is not None
            return self.range_time_s
        if self.objective == "footprint":
            assert self.range_footprint is not None
            return tuple(float(v) for v in self.range_footprint)
        return tuple(float(v) for v in self.range_bytes)

    @property
    def balance(self) -> float:
        """Largest range / mean range of the balanced quantity: 1.0 is perfectly even."""
        values = self.objective_values()
        mean = sum(values) / len(values)
        return max(values) / mean if mean > 0 else 1.0

    def names_in(self, index: int) -> tuple[str, ...]:
        a, b = self.ranges[index]
        return self.block_names[a:b]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.structs.asdict(self)
        out["block_names"] = list(self.block_names)
        out["block_bytes"] = list(self.block_bytes)
        out["ranges"] = [list(r) for r in self.ranges]
        out["range_bytes"] = list(self.range_bytes)
        for key in ("range_time_s", "range_footprint"):
            if out[key] is not None:
                out[key] = list(out[key])
        out["request"] = dict(self.request)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if not isinstance(data, dict):
            raise _bad("a plan must be a mapping")
        if data.get("version") != PLAN_VERSION:
            raise FlowmeshError(
                Code.PLAN_ERROR,
                f"plan version {data.get('version')!r} is not supported (this partitioner reads "
                f"version {PLAN_VERSION}); re-plan the model",
            )
        known = set(cls.__struct_fields__)
        unknown = sorted(set(map(str, data)) - known)
        if unknown:
            raise _bad(f"unknown field(s): {', '.join(unknown)}")
        required = {"kind", "spec_digest", "block_names", "block_bytes", "ranges"}
        missing = sorted((required | {"range_bytes", "objective"}) - set(data))
        if missing:
            raise _bad(f"missing field(s): {', '.join(missing)}")
        return cls(**data)

    # -- showing -------------------------------------------------------------------------

    def table(self) -> str:
        """A readable table: one row per stage/chunk, then the balance."""
        unit = "stage" if self.kind == "stages" else "chunk"
        header = [unit, "blocks", "names", "bytes"]
        if self.range_footprint is not None:
            header.append("footprint")
        if self.range_time_s is not None:
            header.append("fwd time" if self.kind == "stages" else "fwd+bwd time")
        header.append("share")
        values = self.objective_values()
        total = sum(values) or 1.0
        rows = [header]
        for i, (a, b) in enumerate(self.ranges):
            names = self.block_names[a:b]
            span = f"{a}" if b - a == 1 else f"{a}-{b - 1}"
            label = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            row = [str(i), span, label, human_bytes(self.range_bytes[i])]
            if self.range_footprint is not None:
                row.append(human_bytes(self.range_footprint[i]))
            if self.range_time_s is not None:
                row.append(_human_seconds(self.range_time_s[i]))
            row.append(f"{100 * values[i] / total:.1f}%")
            rows.append(row)
        widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in rows
        ]
        what = {"time": "time", "bytes": "bytes", "footprint": "training footprint"}
        lines.append(
            f"{self.parts} {unit}s over {len(self.block_names)} blocks; balance "
            f"{self.balance:.3f} (largest / mean {what[self.objective]})"
        )
        return "\n".join(lines)


def _human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} us"


# -- planning from a profile (no torch) ---------------------------------------------------------


def ranges_of(bounds: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Fencepost bounds as (start, stop) ranges."""
    return tuple(itertools.pairwise(bounds))


def range_times(
    profile: ModelProfile, ranges: Sequence[tuple[int, int]], attr: str
) -> tuple[float, ...] | None:
    """Each range's summed block times (`attr` of each block), None unless every block was
    timed."""
    times = [getattr(b, attr) for b in profile.blocks]
    if any(t is None for t in times):
        return None
    return tuple(sum(times[a:b]) for a, b in ranges)


@contextlib.contextmanager
def explain_uncut(profile: ModelProfile) -> Iterator[None]:
    """A model that could not be cut is one block: when that block cannot be planned (split into
    several parts, or over a cap), say why it is one block."""
    try:
        yield
    except FlowmeshError as exc:
        if profile.uncut is None or exc.code != Code.PLAN_ERROR:
            raise
        raise FlowmeshError(
            Code.NOT_A_CHAIN, f"{exc.reason}; the model is a single block: {profile.uncut}"
        ) from None


def chunk_plan(
    profile: ModelProfile,
    target_bytes: int,
    optimizer: str | Mapping[str, Any],
    batch: int,
    states: int | None = None,
) -> Plan:
    """Training chunks from a profile (see `planners.chunks`); `states`: the optimizer's state
    tensors per parameter, as `flowmesh.optimizers.state_count` counts them."""
    with explain_uncut(profile):
        bounds = planners.chunks(target_bytes, profile, optimizer, batch, states)
    footprints, margin = planners.chunk_footprints(profile, optimizer, batch, states)
    ranges = ranges_of(bounds)
    return Plan(
        kind="chunks",
        spec_digest=profile.spec_digest,
        block_names=tuple(profile.names),
        block_bytes=tuple(b.own_bytes for b in profile.blocks),
        ranges=ranges,
        range_bytes=tuple(profile.range_bytes(a, b) for a, b in ranges),
        objective="footprint",
        range_time_s=range_times(profile, ranges, "forward_backward_s"),
        range_footprint=tuple(sum(footprints[a:b]) + margin for a, b in ranges),
        request={
            "target_bytes": target_bytes,
            "optimizer": dict(optimizer) if isinstance(optimizer, Mapping) else optimizer,
            "optimizer_states": planners.optimizer_states(optimizer, states),
            "batch": batch,
        },
    )
