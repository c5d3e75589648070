"""Who is in the mesh: peers' registration, heartbeats and loss.

Part of the broker's registry (`broker.registry`); a plain class, no sockets, no clock of its
own. A process registering again keeps its state; a restarted one replaces its old self once
that is lost; a name a live peer of another process holds is refused with `name_taken`. A peer
is ready on its first heartbeat and lost when silent past liveness (`tick`) or unreachable; a
lost peer's calls fail and its replicas are dropped and re-created elsewhere
(`broker.placement`). A worker registering afresh hands its inventory to `broker.restore`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from broker.catalogue import Catalogue
from broker.context import BACKEND, Context, fail
from broker.placement import Placement
from broker.policy import heart_failed
from broker.restore import Restorer
from broker.state import Model, Peer, Replica
from flowmesh import protocol as p
from flowmesh.auth import Identity, check_registration
from flowmesh.errors import Code, FlowmeshError
from flowmesh.logs import LogThrottle

log = logging.getLogger("broker.peers")


class Membership:
    def __init__(
        self,
        ctx: Context,
        catalogue: Catalogue,
        placement: Placement,
        restorer: Restorer,
        *,
        on_change: Callable[[float], None],
        on_replica_lost: Callable[[Model, Replica, str, float], None],
        on_worker_lost: Callable[[str], None],
        on_worker_joined: Callable[[str, list[p.HeldJob], float], None],
    ) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        # The shared tables, under short names (the very dicts: never rebound).
        self.peers = ctx.peers
        self.by_addr = ctx.by_addr
        self.models = ctx.models
        self.calls = ctx.calls
        self.catalogue = catalogue
        self.placement = placement
        self.restorer = restorer
        self.on_change = on_change
        self.on_replica_lost = on_replica_lost
        self.on_worker_lost = on_worker_lost
        self.on_worker_joined = on_worker_joined
        # Registrations refused for a name a live peer holds: a flood of them logs a few lines.
        self.refusals = LogThrottle(log)

    def register(
        self,
        addr: bytes,
        msg: p.Register,
        now: float,
        identity: Identity | None = None,
        *,
        keyed: bool = False,
    ) -> None:
        """`keyed` (CURVE on): only under the name and role `identity`'s certificate grants."""
        if keyed:
            try:
                check_registration(identity, msg.name, msg.role)
            except FlowmeshError:
                self.ctx.totals["auth_refused"] = self.ctx.totals.get("auth_refused", 0) + 1
                self.refusals.warning(
                    "refused registration name=%s role=%s key=%s",
                    msg.name,
                    msg.role,
                    identity.name if identity else None,
                )
                raise
        if msg.role not in ("worker", "partitioner"):
            raise fail(Code.BAD_REQUEST, f"unknown role {msg.role!r}")
        if msg.role == "worker" and msg.budget_bytes <= 0:
            raise fail(Code.BAD_REQUEST, "a worker must report a positive memory budget")
        if not msg.name:
            raise fail(Code.BAD_REQUEST, "a peer needs a name")
        held_stages, held_jobs = check_inventory(msg.inventory)
        old = self.peers.get(msg.name)
        if (
            old is not None
            and same_process(old, addr, msg)
            and self.by_addr.get(addr) in (None, msg.name)
        ):
            # The same process registering again (it missed our heartbeats, or opened a fresh
            # socket): it still holds what it held, so keep its state and work in flight.
            if old.addr != addr:
                self.by_addr.pop(old.addr, None)
                old.addr = addr
            self.by_addr[addr] = old.name
            old.last_seen = now
            old.registrations += 1
            self.ctx.send(BACKEND, addr, self._ack(msg.id, kept=True))
            log.info(
                "registered again name=%s role=%s pid=%d (state kept, %d registrations)",
                msg.name,
                msg.role,
                msg.pid,
                old.registrations,
            )
            return
        if old is not None and old.addr != addr and not self._silent(old, now):
            # Another process under a name a live peer holds: an impostor, or a second worker
            # started under the same name. Refused (its process stops), never flapping between
            # the two; a restarted process gets in once its predecessor is lost (its connection
            # gone, the next tick's heartbeat cannot reach it; or silent past liveness).
            self.ctx.totals["names_refused"] = self.ctx.totals.get("names_refused", 0) + 1
            self.refusals.warning(
                "refused registration name=%s role=%s pid=%d: held by the live pid %d",
                msg.name,
                msg.role,
                msg.pid,
                old.pid,
            )
            raise fail(
                Code.NAME_TAKEN,
                f"name {msg.name!r} is held by a live {old.role} of another process (pid "
                f"{old.pid}, heard from {now - old.last_seen:.1f} s ago): start this one under "
                "another --name, or stop that one first",
            )
        if old is not None:
            self.peer_dead(old, now, "re-registered (restarted)")
        stale = self.by_addr.get(addr)
        if stale is not None and stale in self.peers:
            self.peer_dead(self.peers[stale], now, "re-registered under another name")
        self.peers[msg.name] = Peer(
            name=msg.name,
            addr=addr,
            role=msg.role,
            pid=msg.pid,
            device=msg.device,
            kind=msg.kind,
            budget=msg.budget_bytes,
            info=msg.info,
            stats=p.PartitionerStats() if msg.role == "partitioner" else p.WorkerStats(),
            last_seen=now,
            max_inflight=2 * msg.info.compute_lanes,
            key=identity.public if keyed and identity is not None else "",
        )
        self.by_addr[addr] = msg.name
        self.ctx.send(BACKEND, addr, self._ack(msg.id, kept=False))
        log.info(
            "registered name=%s role=%s pid=%d holding stages=%d jobs=%d",
            msg.name,
            msg.role,
            msg.pid,
            len(held_stages),
            len(held_jobs),
        )
        if msg.role == "worker":
            self.restorer.adopt(self.peers[msg.name], held_stages, now)
            self.on_worker_joined(msg.name, held_jobs, now)
            self.restorer.finish_restore(now)

    def _silent(self, peer: Peer, now: float) -> bool:
        return heart_failed(peer.last_seen, now, self.cfg.heartbeat_s, self.cfg.liveness)

    def _ack(self, ref: int, *, kept: bool) -> p.RegisterAck:
        return p.RegisterAck(
            id=ref,
            heartbeat_s=self.cfg.heartbeat_s,
            liveness=self.cfg.liveness,
            kept=kept,
            allow=list(self.cfg.allow),
        )

    def heartbeat(self, peer: Peer, msg: p.Heartbeat, now: float) -> None:
        if msg.stats is not None:
            # Types and bounds were checked on receipt (`flowmesh.reports.WorkerStats`); here,
            # that they are the figures of the role the peer registered with.
            if type(msg.stats) is not type(peer.stats):
                raise fail(
                    Code.BAD_REQUEST,
                    f"heartbeat stats: a {peer.role} reports {type(peer.stats).__name__}, "
                    f"not {type(msg.stats).__name__}",
                )
            peer.stats = msg.stats
        if not peer.ready:
            peer.ready = True
            log.info(
                "peer ready name=%s role=%s device=%s budget=%d",
                peer.name,
                peer.role,
                peer.device,
                peer.budget,
            )
            self.placement.reconcile(now)
            self.on_change(now)

    def check_hearts(self, now: float) -> None:
        """Heartbeats out to live peers; peers silent too long are lost."""
        for peer in list(self.peers.values()):
            if heart_failed(peer.last_seen, now, self.cfg.heartbeat_s, self.cfg.liveness):
                self.peer_dead(peer, now, "missed heartbeats")
            else:
                self.ctx.to_peer(peer.name, p.Heartbeat())

    def peer_unreachable(self, addr: bytes, now: float) -> None:
        name = self.by_addr.get(addr)
        if name is not None:
            self.peer_dead(self.peers[name], now, "unreachable")

    def peer_dead(self, peer: Peer, now: float, why: str) -> None:
        self.peers.pop(peer.name, None)
        if self.by_addr.get(peer.addr) == peer.name:
            del self.by_addr[peer.addr]
        log.warning("peer lost name=%s role=%s why=%s", peer.name, peer.role, why)
        for cid, call in list(self.calls.items()):
            if call.peer != peer.name:
                continue
            del self.calls[cid]
            if call.kind == "plan":
                self.catalogue.plan_failed(
                    call,
                    str(Code.UNAVAILABLE),
                    f"partitioner {peer.name} was lost while planning",
                    now,
                )
            elif call.kind == "stage":
                self.catalogue.stage_failed(
                    call, f"worker {peer.name} was lost while deploying", str(Code.WORKER_LOST), now
                )
        if peer.role != "worker":
            return
        self.on_worker_lost(peer.name)
        for model in list(self.models.values()):
            lost = [r for r in model.replicas if peer.name in r.workers]
            for rep in lost:
                model.replicas.remove(rep)
                self.placement.drop_replica(model.name, rep, lost=peer.name)
                self.on_replica_lost(model, rep, peer.name, now)
            if lost:
                self.placement.persist(model)
        self.placement.reconcile(now)
        for model in self.models.values():
            if not model.replicas:
                self.placement.mark_availability(model, f"lost with worker {peer.name}")
        self.on_change(now)


def same_process(old: Peer, addr: bytes, msg: p.Register) -> bool:
    """`msg` comes from the very process that registered `old`: on the same connection (the
    broker names connections, and none can take another's), or on a fresh one with the secret
    that process sent with its first registration (`info.session`, see `flowmesh.peer`). A
    pid and a budget alone, which anyone reading status knows, prove nothing."""
    if (old.role, old.pid, old.budget) != (msg.role, msg.pid, msg.budget_bytes):
        return False
    if old.addr == addr:
        return True
    session, known = msg.info.session, old.info.session
    return bool(known) and secrets.compare_digest(session.encode(), known.encode())


def check_inventory(inv: p.Inventory) -> tuple[list[p.HeldStage], list[p.HeldJob]]:
    """The stages and jobs of a registration's inventory (typed and checked on receipt:
    `p.Inventory`), refused with BAD_REQUEST if a stage is listed twice, before the
    registration changes anything."""
    if len({(s.model, s.stage) for s in inv.stages}) != len(inv.stages):
        raise fail(Code.BAD_REQUEST, "register inventory stages: a stage is listed twice")
    return inv.stages, inv.jobs
