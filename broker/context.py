"""What every room of the broker shares: the tables, one id counter, the outbox, the totals.

The rooms (`Registry`, `ServingRouter`, `TrainingRouter`) each own one job, but they act on the
same peers and models and answer through the same outbox, so those live here, once. Also here:
the few acts more than one room performs (evicting a stage, failing a request), so that each
keeps its counters in one place. Plain data and appends to `out`; no sockets, no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from broker.config import BrokerConfig
from broker.state import Call, Model, ModelState, Peer, Request, StageKey
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError

CLIENT, BACKEND = "client", "backend"  # the two sockets an outgoing message may leave by

Outgoing = tuple[str, bytes, p.Message]  # (CLIENT | BACKEND, routing id, message)


def fail(code: Code, reason: str) -> FlowmeshError:
    return FlowmeshError(code, reason)


class Context:
    def __init__(self, cfg: BrokerConfig) -> None:
        self.cfg = cfg
        self.peers: dict[str, Peer] = {}
        self.by_addr: dict[bytes, str] = {}
        self.models: dict[str, Model] = {}
        # Every call awaiting a peer's answer (plans, stage deploys, loads), by id: one table,
        # because an error or a failed send names only the id.
        self.calls: dict[int, Call] = {}
        self.out: list[Outgoing] = []
        # Requests of each client queued or running (entries at zero are removed: bounded by the
        # clients with work in flight).
        self.outstanding: dict[bytes, int] = {}
        # One counter for every id the broker hands out (calls, runs, requests, evictions), so
        # that an id names one thing whichever room made it.
        self.ids: Iterator[int] = itertools.count(1)
        self.totals: dict[str, Any] = {
            "requests": 0,
            "completed": 0,
            "errors": 0,
            "batches": 0,
            "retried": 0,
            "hung_runs": 0,
            "expired_calls": 0,
            "dropped_sends": 0,
            "direct_batches": 0,  # multi-stage batches whose activations went worker to worker
            "activation_bytes_relayed": 0,  # activations forwarded by the broker between stages
        }

    # -- the checks every call that runs a model makes at the door (Infer, Generate)

    def deployed(self, name: str) -> Model:
        """Model `name`; MODEL_NOT_FOUND naming those deployed."""
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise fail(Code.MODEL_NOT_FOUND, f"no model {name!r} (deployed: {known})")
        return model

    @staticmethod
    def check_ready(model: Model) -> None:
        """UNAVAILABLE unless `model` serves now; MODEL_NOT_FOUND while it is undeployed."""
        if model.drain is not None:
            raise fail(
                Code.MODEL_NOT_FOUND,
                f"{model.name!r} is being undeployed (waiting for its running generations to "
                "end); it takes no new calls",
            )
        if model.state is ModelState.UNAVAILABLE:
            raise fail(
                Code.UNAVAILABLE,
                f"{model.name!r} has no live replica; waiting for workers to join",
            )
        if model.state is not ModelState.READY:
            raise fail(Code.UNAVAILABLE, f"{model.name!r} is still {model.state.value}")

    def client_room(self, addr: bytes) -> int:
        """`addr`'s calls queued or running; OVERLOADED at the per-client limit."""
        mine = self.outstanding.get(addr, 0)
        if mine >= self.cfg.max_client_inflight:
            raise fail(
                Code.OVERLOADED,
                f"this client has {mine} requests queued or running (limit "
                f"{self.cfg.max_client_inflight} per client); wait for answers, then retry",
            )
        return mine

    def client_done(self, addr: bytes) -> None:
        """One of `addr`'s requests was answered."""
        n = self.outstanding.get(addr, 0) - 1
        if n > 0:
            self.outstanding[addr] = n
        else:
            self.outstanding.pop(addr, None)

    # ------------------------------------------------------------------ sending

    def send(self, dest: str, addr: bytes, msg: p.Message) -> None:
        self.out.append((dest, addr, msg))

    def to_client(self, addr: bytes, msg: p.Message) -> None:
        self.send(CLIENT, addr, msg)

    def to_peer(self, name: str, msg: p.Message) -> None:
        self.send(BACKEND, self.peers[name].addr, msg)

    def to_worker(self, name: str, msg: p.Message) -> None:
        if name in self.peers:  # one lost meanwhile has nothing left to be told
            self.to_peer(name, msg)

    def drain(self) -> list[Outgoing]:
        out, self.out = self.out, []
        return out

    # ------------------------------------------------------------------ lookups

    def workers(self, ready_only: bool = True) -> list[Peer]:
        return [
            w for w in self.peers.values() if w.role == "worker" and (w.ready or not ready_only)
        ]

    # ------------------------------------------------------------------ shared acts

    def evict(self, peer: Peer, key: StageKey) -> None:
        """Drop a stage's device copy on `peer`: the bytes count as free from now on."""
        peer.resident.pop(key, None)
        self.count_eviction(peer, key)
        self.to_peer(peer.name, p.Evict(id=next(self.ids), model=key[0], stage=key[1]))

    def count_eviction(self, peer: Peer, key: StageKey) -> None:
        peer.evictions += 1
        victim = self.models.get(key[0])
        if victim is not None:
            victim.evictions += 1

    def answer_error(self, req: Request, code: Code | str, reason: str) -> None:
        """Fail a request once (a request already answered is left alone)."""
        if req.client is None:
            return
        self.to_client(req.client, p.Error(id=req.client_id, code=str(code), reason=reason))
        self.client_done(req.client)
        req.client = None  # type: ignore[assignment]
        model = self.models.get(req.model)
        if model is not None:
            model.errors += 1
            model.errors_by_code[str(code)] = model.errors_by_code.get(str(code), 0) + 1
        self.totals["errors"] += 1
