"""The broker's registry: who is in the mesh, which models are deployed, where their stages live.

Its parts, one job each, wired to one another here for `BrokerCore` (and for the tests that
drive them together); each is a plain class, no sockets, no clock of its own:

- `broker.peers` `Membership`: registration, heartbeats, the loss of a peer;
- `broker.catalogue` `Catalogue`: deploy, undeploy, plans and the plan cache, and the answers
  to the plan and stage calls these make;
- `broker.placement` `Placement`: where replicas go, their stages deployed, repair
  (`reconcile`), and the placement kept in the store (`--state-dir`);
- `broker.autoscale` `Autoscaler`: one replica more or fewer, as the load says;
- `broker.restore` `Restorer`: what a restarted broker takes up again.

What it does not decide: which requests run and which stages are resident (`ServingRouter`), and
training jobs (`TrainingRouter`). It tells the others through four callbacks: `on_change` (a
replica became ready, a worker joined, a queue was answered: start what can start now),
`on_replica_lost` (a replica's runs in flight need failing over), `on_worker_lost` (a worker's
training jobs are gone) and `on_worker_joined` (a worker registered afresh with these jobs).
"""

from __future__ import annotations

from collections.abc import Callable

from broker.autoscale import Autoscaler
from broker.catalogue import Catalogue
from broker.context import Context
from broker.peers import Membership
from broker.placement import Placement
from broker.restore import Restorer
from broker.state import Model, Replica
from broker.store import Store
from flowmesh import protocol as p


class Registry:
    def __init__(
        self,
        ctx: Context,
        *,
        on_change: Callable[[float], None],
        on_replica_lost: Callable[[Model, Replica, str, float], None],
        on_worker_lost: Callable[[str], None],
        on_worker_joined: Callable[[str, list[p.HeldJob], float], None] | None = None,
    ) -> None:
        self.ctx = ctx
        # The shared tables, under short names (the very dicts: never rebound).
        self.peers = ctx.peers
        self.by_addr = ctx.by_addr
        self.models = ctx.models
        self.calls = ctx.calls
        self.placement = placement = Placement(ctx)
        self.catalogue = catalogue = Catalogue(ctx, placement, on_change)
        self.restorer = restorer = Restorer(ctx, placement, on_change)
        self.autoscaler = Autoscaler(ctx, placement)
        self.membership = membership = Membership(
            ctx,
            catalogue,
            placement,
            restorer,
            on_change=on_change,
            on_replica_lost=on_replica_lost,
            on_worker_lost=on_worker_lost,
            # A worker registered afresh, with the training jobs it holds (its inventory's "jobs").
            on_worker_joined=on_worker_joined or (lambda name, jobs, now: None),
        )
        self.plan_cache = catalogue.plan_cache
        # The entry points, each the method of the part whose job it is.
        self.register = membership.register
        self.heartbeat = membership.heartbeat
        self.check_hearts = membership.check_hearts
        self.peer_unreachable = membership.peer_unreachable
        self.peer_dead = membership.peer_dead
        self.deploy = catalogue.deploy
        self.undeploy = catalogue.undeploy
        self.plan_request = catalogue.plan_request
        self.plan_reply = catalogue.plan_reply
        self.stage_ready = catalogue.stage_ready
        self.deploy_overdue = catalogue.deploy_overdue
        self.call_failed = catalogue.call_failed
        self.call_expired = catalogue.call_expired
        self.reconcile = placement.reconcile
        self.give_up_replica = placement.give_up_replica
        self.autoscale = self.autoscaler.autoscale
        self.restore = restorer.restore
        self.finish_restore = restorer.finish_restore

    @property
    def store(self) -> Store | None:
        """Where deployed models are kept across restarts (`--state-dir`); None: nowhere."""
        return self.placement.store

    @store.setter
    def store(self, store: Store | None) -> None:
        self.placement.store = store

    @property
    def restore_until(self) -> float | None:
        """After a restart, until when the broker waits for workers to bring stages back."""
        return self.restorer.restore_until
