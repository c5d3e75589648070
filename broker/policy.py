"""The broker's choices as pure functions over plain state: liveness, eviction, placement.

Kept apart from the rooms that use them (`broker.peers`, `broker.placement`, `broker.autoscale`,
`broker.serving_router`) so each rule is tested with exact expectations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from broker.state import Peer, Residency, StageKey
from flowmesh.eviction import eviction_order


def heart_failed(last_seen: float, now: float, period: float, liveness: int) -> bool:
    """A peer is dead once `liveness` heartbeat periods passed without a word from it."""
    return now - last_seen > period * liveness


def pick_victims(
    worker: Peer,
    need: int,
    evictable: Callable[[Residency], bool],
    *,
    value: Callable[[Residency], float] | None = None,
    max_stages: int | None = None,
    kv: Mapping[StageKey, int] | None = None,
) -> list[StageKey] | None:
    """Evictable stages whose bytes make room for `need` more bytes, in `eviction_order`: the
    lowest `value` first (`stage_value`: a hot model is not thrown out for a one-off request),
    least recently used among equals; least recently used alone when no `value` is given.

    `max_stages`: also keep at most that many stages resident, the new one included (a
    count-based policy, as Computron's). Returns [] when the bytes are already free, None when
    no choice of victims is enough.

    `kv`: the live KV bytes stages hold there (the worker's `kv_stage_bytes`): a stage's
    resident bytes are its weights + its KV, and the free room is the budget less both, of every
    stage. A stage holding KV goes last, only when the others are not enough: evicting it
    preempts its sequences (their KV recomputed or lost), as a starving load preempts work.

    This is the broker's expectation, to choose a replica and account its bytes; the worker
    makes the actual choice (`gpu_worker.executor`), knowing its arena's layout, and reports it.
    """
    if need > worker.budget:
        return None
    held = kv or {}

    def kv_of(r: Residency) -> int:
        return held.get(r.key, 0)

    free = worker.free - sum(kv_of(r) for r in worker.resident.values())
    count = len(worker.resident) + 1

    def enough() -> bool:
        return free >= need and (max_stages is None or count <= max_stages)

    if enough():
        return []
    order = eviction_order(worker.resident.values(), value)
    order = [r for r in order if not kv_of(r)] + [r for r in order if kv_of(r)]  # KV: last
    chosen: list[StageKey] = []
    for r in order:
        if enough():
            break
        if evictable(r):
            chosen.append(r.key)
            free += r.nbytes + kv_of(r)
            count -= 1
    return chosen if enough() else None


def place_replicas(
    workers: Iterable[Peer],
    stage_bytes: list[int],
    replicas: int,
    taken: set[tuple[int, str]] | None = None,
) -> list[list[str]]:
    """Up to `replicas` placements; in each, stage i goes to a distinct worker that can hold it
    and does not already hold stage i of this model (`taken`: (stage, worker) pairs in use).

    Stages are placed largest first on the worker with the least hosted bytes (ties by name), so
    host memory and device traffic spread evenly. Returns fewer placements when workers run out.

    A model that has no placement on distinct workers at all (more stages than workers that can
    hold them, and no other replica: `taken` empty) gets one placement whose workers each hold
    a run of consecutive stages (`shared_placement`): a streamed replica, whose stages take turns
    on the device (`broker.serving_router`). Each stage still fits its worker's budget.
    """
    taken = set(taken or ())
    pool = sorted(workers, key=lambda w: w.name)
    hosted = {w.name: sum(w.hosted.values()) for w in pool}
    out: list[list[str]] = []
    order = sorted(range(len(stage_bytes)), key=lambda i: -stage_bytes[i])
    for _ in range(replicas):
        chosen: dict[int, str] = {}
        for i in order:
            fits = [
                w
                for w in pool
                if w.budget >= stage_bytes[i]
                and w.name not in chosen.values()
                and (i, w.name) not in taken
            ]
            if not fits:
                if not out and not taken:
                    shared = shared_placement(pool, stage_bytes, hosted)
                    return [shared] if shared is not None else []
                return out
            best = min(fits, key=lambda w: (hosted[w.name], w.name))
            chosen[i] = best.name
            hosted[best.name] += stage_bytes[i]
        out.append([chosen[i] for i in range(len(stage_bytes))])
        taken.update(chosen.items())
    return out


def shared_placement(
    pool: list[Peer], stage_bytes: list[int], hosted: dict[str, int]
) -> list[str] | None:
    """One placement of more stages than workers: consecutive stages on one worker (so each
    hop but a few is to itself, and the stage needed next is on the device that computes now),
    the runs balanced by bytes over the workers with the least hosted, and each stage on a
    worker whose budget holds it. None: some stage fits no worker."""
    order = sorted(pool, key=lambda w: (hosted[w.name], w.name))
    if not order or not stage_bytes:
        return None
    share = sum(stage_bytes) / min(len(order), len(stage_bytes))
    out: list[str] = []
    at, filled = 0, 0
    for i, b in enumerate(stage_bytes):
        # On to the next worker once this one has its share (half of this stage past it
        # counts), while there is one, and never leaving a worker with nothing.
        after = len(order) - at - 1  # workers after this one
        if filled and after and (filled + b / 2 > share or len(stage_bytes) - i <= after):
            at, filled = at + 1, 0
        w = order[at]
        if w.budget < b:  # heterogeneous budgets: any worker that holds it, least hosted first
            fit = [v for v in order if v.budget >= b]
            if not fit:
                return None
            w = min(fit, key=lambda v: (hosted[v.name], v.name))
        else:
            filled += b
        out.append(w.name)
    return out


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    xs = sorted(values)
    if not xs:
        return 0.0
    rank = max(1, min(len(xs), -(-len(xs) * q // 100)))
    return xs[int(rank) - 1]


class ScaleStep(NamedTuple):
    """What `scale_step` chose: +1 add a replica, -1 remove one, 0 keep; the new `hot_since` and
    `cool_since` marks (when the model first looked hot / cool in a row; None: it does not)."""

    delta: int
    hot_since: float | None
    cool_since: float | None
    why: str


def scale_step(
    now: float,
    *,
    queue: int,
    rate: float,
    inflight: float,
    service_s: float | None,
    live: int,
    replicas: int,
    floor: int,
    workers: int,
    room: bool,
    hot_since: float | None,
    cool_since: float | None,
    last_scaled: float,
    queue_high: int = 8,
    up_load: float = 0.8,
    down_load: float = 0.4,
    cool_rate: float = 0.05,
    up_after_s: float = 5.0,
    down_after_s: float = 60.0,
    cooldown_s: float = 30.0,
) -> ScaleStep:
    """Whether a model needs one more replica, or one fewer, from plain figures.

    `queue` requests waiting, `rate` arrivals/s (decayed), `inflight` batches in flight per live
    replica, `service_s` a replica's seconds per request (None: not measured yet), `live`
    replicas able to run, `replicas` all of them (some still deploying), `floor` the deployed
    count, `workers` live workers, `room` whether the workers can hold another replica.

    Hot: the queue holds `queue_high` requests per live replica, or the offered load (rate x
    service_s) exceeds `up_load` of the live replicas. Cool: nothing queued, at most one batch
    in flight per replica, and the rate is under `cool_rate` or the load fits in one replica
    fewer at `down_load` (< up_load: hysteresis). Either must hold without a break
    for `up_after_s` / `down_after_s`, and `cooldown_s` must have passed since the last change.
    Never past `workers` replicas or below `floor`; nothing while a replica is deploying.
    """
    load = rate * service_s if service_s else None
    hot = live > 0 and (queue >= queue_high * live or (load is not None and load > up_load * live))
    cool = (
        not hot
        and queue == 0
        and inflight <= 1
        and (rate < cool_rate or (load is not None and load < down_load * (live - 1)))
    )
    hot_since = (now if hot_since is None else hot_since) if hot else None
    cool_since = (now if cool_since is None else cool_since) if cool else None
    settled = replicas == live and now - last_scaled >= cooldown_s
    if not settled:
        return ScaleStep(0, hot_since, cool_since, "")
    if hot and now - hot_since >= up_after_s and replicas < workers and room:  # type: ignore[operator]
        why = (
            f"queue {queue} >= {queue_high} x {live} replica(s)"
            if queue >= queue_high * live
            else f"load {load:.2f} > {up_load} x {live} replica(s)"
        )
        return ScaleStep(1, None, None, why)
    if cool and now - cool_since >= down_after_s and replicas > max(1, floor):  # type: ignore[operator]
        why = (
            f"rate {rate:.3f}/s < {cool_rate}/s"
            if rate < cool_rate
            else f"load {load:.2f} < {down_load} x {live - 1} replica(s)"
        )
        return ScaleStep(-1, None, None, why)
    return ScaleStep(0, hot_since, cool_since, "")
