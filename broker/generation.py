"""The broker's generation room: sequences of `Generate` calls, continuous batching, iterations.

A plain class, driven by `BrokerCore`; no sockets, no clock of its own. Per language model it
keeps the sequences of every Generate call (one per prompt):

- **At the door** (`generate`): the model is deployed from a Hugging Face directory of an
  architecture the workers generate with (`broker.lm_files`, read off the event loop once per
  deploy; a call that comes before the read is done waits for it), every prompt is non-empty,
  its ids inside the vocabulary, and prompt + max_tokens within the model's context
  (`spec.max_context`, else its config's `max_position_embeddings`; never past a learned table
  of positions, `max_context`); max_tokens None is the room the context leaves each prompt
  (`Seq.max_new`). Refusals name the numbers.
- **Waiting and running**: new sequences wait (FIFO; OVERLOADED only at the model's queue limit,
  as for requests); each live replica runs up to `spec.max_seqs` of them. A sequence stays on
  the replica it was prefilled on: its KV cache lives on that replica's workers. A replica
  being scaled down (draining) takes no new sequence and runs its own to their end.
- **Iterations**: a replica of P stages splits its running sequences into up to P groups
  (`BrokerConfig.gen_groups`, 1 by default: one iteration holding them all), each with one
  iteration in flight at a time, so that while one group's iteration is at a
  stage the others' are at other stages and no stage waits for the rest (a model of one stage:
  one group). A new sequence joins the group with the fewest running sequences (the first of
  equals) whose iteration is not in flight, or waits for one; it stays in that group (its KV
  is its own: groups share nothing but the replica). `spec.max_seqs` counts the whole replica.
  An iteration holds every running sequence of its group: a prefill for each sequence that
  joined since the last one (its whole prompt), a decode (its last token) for the others,
  packed in one `Run` (`GenStep`) that the serving router sends exactly as it sends a batch of
  requests (residency, loads, keep lists, direct runs, failover: `ServingRouter.start_gen`).
  The last stage answers one new token per sequence. A sequence ends on an end-of-sequence id
  (unless `ignore_eos`) or one of its `stop_ids` ("stop", the token kept), at `max_tokens`
  ("length"), or by `StopGenerate` ("stop"), as does a streamed call whose chunk finds its
  client gone (`client_gone`); its stages' workers are told to free its KV blocks (`FreeSeqs`,
  parked copies too), never while an iteration holding it (its group's) runs. A streamed call
  gets a `GenChunk` per new token; every call gets one `Generated` once all its sequences
  ended (but one whose client is gone: nobody would read it).
- **Memory**: a stage that cannot place a prefill's KV blocks answers NO_SPACE; that
  iteration's prefills wait again and no new prefill joins that replica until a sequence of the
  model frees memory; the decodes run on. A prefill that fails alone (nothing else running on
  its replica, in any group) could never fit when nothing but its model is resident on those
  workers: TOO_BIG; beside other models it waits for room (`_wait_for_room`: until a sequence
  of any model frees memory or KV_RETRY_S passes, its call's deadline bounding the wait; past
  the starvation limit its try may evict stages holding other models' live sequences).
  Decodes that outgrow the memory preempt the group's newest sequence (a lone one beside other
  models, too, which then waits for room as a lone prefill does): its workers are told to park
  it (`FreeSeqs` with `park`): each keeps its KV in host memory, or drops it where recomputing
  costs less (the worker measures both), and says which (`SeqsParked`). It waits at the head
  of the queue (on its replica, for those answers, PARK_WAIT_S at most); when it joins again on
  the same replica and every stage kept its KV, it resumes where it stopped (a step from its
  parked tokens: the workers copy the KV back); else (another replica took it, or a stage
  dropped it) its KV is recomputed from its tokens.
- **Failures**: the sequences of a replica lost (its worker gone) start again from their
  tokens on another replica, as preempted ones do; with no live replica left their calls
  fail WORKER_LOST. A stage found not resident under a decode (its KV went with it) starts
  its sequences again the same way (its prefills run again, through a Load);
  an iteration that hangs, fails on the worker or returns a malformed answer fails the calls in
  it (the other groups' calls run on: a hang gives up the replica, whose other sequences start
  again from their tokens as those of a lost replica do), but for TOO_BIG, which names its
  longest sequence (that one's KV could never fit a stage's share): only that call fails, the
  others run again (the broker knows no block size to refuse it at the door); a call past its
  timeout is answered TIMEOUT. Whatever happens, every call gets one answer (but one whose
  client is gone).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy

from broker.context import Context, fail
from broker.lm_files import LEARNED_POSITIONS, LmFiles, not_generative
from broker.serving_router import ServingRouter
from broker.state import Batch, Model, ModelState, Replica
from broker.training_router import train_bytes_of
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.messages import MAX_GEN_TOKENS
from flowmesh.value import ArrivalRate

log = logging.getLogger("broker.generation")

# How long a preempted sequence waits for its workers to say they parked its KV before it may
# join its replica again: their answers take one round trip; past this it is recomputed.
PARK_WAIT_S = 1.0
# How long a model whose lone sequence found no KV room beside other models waits before it
# tries again when no sequence frees memory meanwhile (each try is one refused Run).
KV_RETRY_S = 0.25
# How often the client of a call is sent a heartbeat while the call runs: nothing goes to the
# client of a blocking call before its answer, nor to a streamed one's while it waits in the
# queue, and a client gone (its process killed) would otherwise hold its sequences and their KV
# until they end (`client_gone`).
CLIENT_PROBE_S = 2.0


@dataclass(eq=False)
class Call:
    """One Generate: its client, its sequences, its deadline."""

    gm: GenModel
    client: bytes
    client_id: int
    model: str
    sampling: p.Sampling
    stream: bool
    arrived: float
    deadline: float
    seqs: list[Seq] = field(default_factory=list)
    answered: bool = False
    probed: float = 0.0  # when its client was last sent a heartbeat (`probe_clients`)


@dataclass(eq=False)
class Seq:
    """One prompt's sequence: its prompt, its new tokens, where it runs."""

    id: int  # broker-wide (`ctx.ids`): the worker's name for its KV cache
    call: Call
    index: int
    prompt: list[int]
    stops: frozenset[int]
    max_new: int  # its new tokens at most: the call's max_tokens, or what its context leaves
    out: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each new token came
    rep: GenRep | None = None  # the replica it runs on (None: waiting)
    group: Group | None = None  # the group of that replica it runs in, for good
    prefilled: bool = False  # its prompt is in its replica's KV cache
    sent: bool = False  # some worker may hold KV blocks of it (FreeSeqs owed when it ends)
    finish: str | None = None  # "stop" | "length" | "error": it ended
    # Preempted with its KV parked on the workers of replica `parked_rep` (`_park`): the tokens
    # parked (0: none) and the stages that said they keep them (`SeqsParked`).
    parked: int = 0
    parked_rep: Replica | None = None
    parked_ok: set[int] = field(default_factory=set)
    parked_at: float = 0.0  # when it was asked to be parked
    preempted: bool = False  # taken off for memory, not running again yet


@dataclass(eq=False)
class Iteration:
    """One Run of generation: the sequences in it, in token order, and its `GenStep`."""

    step: p.GenStep
    seqs: list[Seq]
    prefill: list[bool]
    frees: int = 0  # the model's FreeSeqs count as it started
    # Per sequence: "swap" (resumed from its parked KV), "recompute" (preempted, its KV
    # recomputed from its tokens) or "" (neither).
    resume: list[str] = field(default_factory=list)


@dataclass(eq=False)
class Group:
    """Running sequences of a replica that iterate together: one iteration of them in flight,
    and on a replica of one stage a second one sent to follow it (`_follow`)."""

    running: list[Seq] = field(default_factory=list)
    batch: Batch | None = None  # the iteration in flight (the older of two)
    ahead: Batch | None = None  # the one sent to follow it on its worker
    # `batch` failed while `ahead` was in flight: that one (now `batch`, whose answer is not
    # taken) is waited for before the failure is dealt with, so that nothing is freed or
    # parked on the worker under an iteration still queued there.
    deferred: tuple[Iteration, str, str] | None = None


@dataclass(eq=False)
class GenRep:
    """A replica's share of a model's generation: its groups of running sequences (one per
    stage, so that each stage can work on one group's iteration while the others are at
    other stages)."""

    rep: Replica
    groups: list[Group]
    # A prefill found no KV room: none joins until a sequence of the model frees memory.
    hold: bool = False
    # Prefills failed together with nothing else running: they join one at a time.
    solo: bool = False

    def running(self) -> list[Seq]:
        """Every running sequence of the replica, group by group."""
        return [s for k in self.groups for s in k.running]

    def busy(self) -> bool:
        """Whether an iteration of it is in flight."""
        return any(k.batch is not None for k in self.groups)


@dataclass(eq=False)
class GenModel:
    """A model's generation state and counters (kept while the model is deployed)."""

    model: Model
    waiting: deque[Seq] = field(default_factory=deque)
    reps: list[GenRep] = field(default_factory=list)
    calls: dict[tuple[bytes, int], Call] = field(default_factory=dict)
    # Calls that came before the model's files were read: (addr, message, arrival).
    held: list[tuple[bytes, p.Generate | p.TokenizerInfo, float]] = field(default_factory=list)
    tokens: int = 0
    iterations: int = 0
    preemptions: int = 0  # sequences taken off a replica for memory, to run again later
    swaps: int = 0  # preempted sequences resumed from their KV, parked in host memory
    recomputes: int = 0  # preempted sequences resumed by recomputing their KV from the tokens
    restarts: int = 0  # sequences started again elsewhere after their replica was lost
    follows: int = 0  # iterations sent to follow the one in flight (`_follow`)
    frees: int = 0  # FreeSeqs rounds sent: memory freed on the workers
    # A lone sequence found no KV room beside other models (`_wait_for_room`): why ("" when
    # not waiting), which sequence, since when, when it may try again, and how many times a
    # sequence of the model had to wait.
    room_wait: str = ""
    room_seq: Seq | None = None
    room_since: float = 0.0
    retry_at: float = 0.0
    room_waits: int = 0
    # New tokens per second, decayed over 10 s (a chat's burst, not the model's whole life).
    token_rate: ArrivalRate = field(default_factory=lambda: ArrivalRate(tau=10.0))

    def running(self) -> int:
        return sum(len(k.running) for g in self.reps for k in g.groups)


@dataclass(frozen=True)
class GenFigures:
    """What status shows of a model's generation."""

    running: int = 0
    waiting: int = 0
    tokens: int = 0
    iterations: int = 0
    preemptions: int = 0
    restarts: int = 0
    tokens_per_s: float = 0.0
    swaps: int = 0
    recomputes: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    itl_p50_ms: float = 0.0
    itl_p99_ms: float = 0.0


class GenerationRoom:
    def __init__(self, ctx: Context, router: ServingRouter) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.peers = ctx.peers
        self.models = ctx.models
        self.router = router
        self.by_model: dict[str, GenModel] = {}
        # Every call not answered yet, by (client, its id): what StopGenerate names.
        self.calls: dict[tuple[bytes, int], Call] = {}
        # Directory reads the shell is to run on a thread: (model, hf directory).
        self.reads: list[tuple[str, str]] = []
        # Preempted sequences whose KV their workers were asked to park, by id (`seqs_parked`).
        self.parked: dict[int, Seq] = {}
        # A model being undeployed has no generation left (`Catalogue.check_drain`; set by the
        # broker core, which holds both rooms).
        self.on_drained: Callable[[Model, float], None] = lambda model, now: None

    # ================================================================== the door

    def generate(
        self, addr: bytes, msg: p.Generate, now: float, arrived: float | None = None
    ) -> None:
        """Check a Generate and queue its sequences (`arrived`: when it came, for one that
        waited for the model's files)."""
        model = self._model(msg.model)
        gm = self._gen_model(model)
        if model.lm is None:
            self._hold(gm, addr, msg, now)
            return
        arrived = now if arrived is None else arrived
        files = self._files(model)
        if msg.tokenizer and msg.tokenizer != files.digest:
            raise fail(
                Code.TOKENIZER_CHANGED,
                f"{model.name!r} was deployed again with another tokenizer than the one the "
                "prompts were encoded with; fetch it again",
            )
        limit = self.max_context(model)
        if not msg.prompts:
            raise fail(Code.BAD_REQUEST, "generate needs at least one prompt")
        max_tokens = msg.sampling.max_tokens
        if max_tokens is None and limit is None:
            raise fail(
                Code.BAD_REQUEST,
                f"{model.name!r} has no known context length (no max_context in its deploy, "
                "no max_position_embeddings in its config): give max_tokens",
            )
        max_new: list[int] = []
        for i, prompt in enumerate(msg.prompts):
            if not prompt:
                raise fail(Code.BAD_REQUEST, f"prompt {i} is empty: give at least one token id")
            if files.vocab_size is not None and max(prompt) >= files.vocab_size:
                raise fail(
                    Code.BAD_REQUEST,
                    f"prompt {i} holds token id {max(prompt)}, outside the vocabulary of "
                    f"{model.name!r} ({files.vocab_size} ids)",
                )
            if max_tokens is None:
                assert limit is not None
                if len(prompt) >= limit:
                    raise fail(
                        Code.BAD_REQUEST,
                        f"prompt {i} has {len(prompt)} tokens: the max_context of "
                        f"{model.name!r} ({limit}) leaves no room for a new one",
                    )
                max_new.append(min(limit - len(prompt), MAX_GEN_TOKENS))
                continue
            if limit is not None and len(prompt) + max_tokens > limit:
                raise fail(
                    Code.BAD_REQUEST,
                    f"prompt {i} has {len(prompt)} tokens and max_tokens is {max_tokens}: "
                    f"{len(prompt) + max_tokens} is over the max_context of {model.name!r} "
                    f"({limit})",
                )
            max_new.append(max_tokens)
        # (A replica on its way, being repaired, is not live yet: the call waits for it.)
        if model.replicas and all(r.streamed for r in model.replicas):
            raise fail(
                Code.BAD_REQUEST,
                f"{model.name!r} runs streamed (more stages than workers): generation needs "
                "each stage on a worker of its own",
            )
        if len(gm.waiting) + len(msg.prompts) > self.cfg.max_queue:
            raise fail(
                Code.OVERLOADED,
                f"{model.name!r} has {len(gm.waiting)} sequences waiting (limit "
                f"{self.cfg.max_queue}); retry later",
            )
        mine = self.ctx.client_room(addr)
        if (addr, msg.id) in self.calls:
            raise fail(Code.BAD_REQUEST, f"generate {msg.id} is already running")
        timeout = (msg.timeout_ms / 1000) if msg.timeout_ms else self.cfg.default_timeout_s
        call = Call(
            gm=gm,
            client=addr,
            client_id=msg.id,
            model=model.name,
            sampling=msg.sampling,
            stream=msg.stream,
            arrived=arrived,
            deadline=arrived + timeout,
        )
        eos = frozenset() if msg.sampling.ignore_eos else frozenset(files.eos_ids)
        stops = eos | frozenset(msg.sampling.stop_ids)
        for i, prompt in enumerate(msg.prompts):
            call.seqs.append(Seq(next(self.ctx.ids), call, i, list(prompt), stops, max_new[i]))
        gm.calls[(addr, msg.id)] = call
        self.calls[(addr, msg.id)] = call
        gm.waiting.extend(call.seqs)
        self.ctx.outstanding[addr] = mine + 1
        model.rate.add(now)
        model.requests += 1
        self.ctx.totals["requests"] += 1
        self.pump(now)

    def stop(self, addr: bytes, msg: p.StopGenerate, now: float) -> None:
        """End sequences of a running call as "stop" (not answered itself; a late or unknown
        one changes nothing)."""
        call = self.calls.get((addr, msg.id))
        if call is None:
            return
        wanted = range(len(call.seqs)) if msg.indexes is None else msg.indexes
        for i in wanted:
            if i < len(call.seqs) and call.seqs[i].finish is None:
                self._end(call.seqs[i], "stop")
        self._maybe_done(call, now)
        self.pump(now)

    def client_gone(self, addr: bytes, client_id: int, now: float) -> None:
        """A chunk of call `client_id` (or a heartbeat) could not reach its client, gone: the
        call ends as `stop` ends it (its sequences "stop", their KV freed, never under an
        iteration that holds them), answered to nobody (nobody would read it); its client's
        other calls run on. A late or unknown one changes nothing."""
        call = self.calls.get((addr, client_id))
        if call is None:
            return
        log.info("model=%s client %r is gone: its generate %d stops", call.model, addr, client_id)
        for s in call.seqs:
            if s.finish is None:
                s.finish = "stop"
            self._drop(s)
        self._close(call)
        self.pump(now)

    def tokenizer_info(self, addr: bytes, msg: p.TokenizerInfo, now: float) -> None:
        model = self._model(msg.model)
        if model.lm is None:
            self._hold(self._gen_model(model), addr, msg, now)
            return
        files = self._files(model)
        if files.tokenizer_json is None:
            why = f" ({files.tokenizer_error})" if files.tokenizer_error else ""
            raise fail(
                Code.BAD_REQUEST,
                f"{model.name!r} has no tokenizer in its directory{why}; generate from token ids",
            )
        self.ctx.to_client(
            addr,
            p.TokenizerReply(
                id=msg.id,
                model=model.name,
                tokenizer_json=files.tokenizer_json,
                chat_template=files.chat_template,
                eos_ids=list(files.eos_ids),
                bos_id=files.bos_id,
                max_context=self.max_context(model) or 0,
                bos_token=files.bos_token,
                eos_token=files.eos_token,
                digest=files.digest,
            ),
        )

    def _model(self, name: str) -> Model:
        model = self.ctx.deployed(name)
        if model.spec.hf is None:
            raise not_generative(f"{name!r} is not a language model (deployed from a factory)")
        self.ctx.check_ready(model)
        return model

    @staticmethod
    def _files(model: Model) -> LmFiles:
        files: LmFiles = model.lm
        if files.error is not None:
            raise FlowmeshError(files.error.code, f"{model.name!r}: {files.error.reason}")
        return files

    @staticmethod
    def max_context(model: Model) -> int | None:
        """The longest sequence (prompt + new tokens) `model` takes; None: no limit known. The
        deploy's max_context, else the config's positions; never past a learned table of
        positions (its embedding has no row for the next one)."""
        files: LmFiles | None = model.lm
        table = files.max_positions if files is not None else None
        if model.spec.max_context is None:
            return table
        if table is not None and files is not None and files.architecture in LEARNED_POSITIONS:
            return min(model.spec.max_context, table)
        return model.spec.max_context

    def _gen_model(self, model: Model) -> GenModel:
        gm = self.by_model.get(model.name)
        if gm is None or gm.model is not model:
            gm = self.by_model[model.name] = GenModel(model)
        return gm

    # ================================================================== the model's files

    def _hold(
        self, gm: GenModel, addr: bytes, msg: p.Generate | p.TokenizerInfo, now: float
    ) -> None:
        """Keep a call until the model's files are read (asking for the read)."""
        if len(gm.held) >= self.cfg.max_queue:
            raise fail(Code.OVERLOADED, f"{gm.model.name!r}: its files are still being read; retry")
        gm.held.append((addr, msg, now))
        self.want_files(gm.model)

    def want_files(self, model: Model) -> None:
        """Ask the shell to read `model`'s directory, once per deploy."""
        if model.spec.hf is not None and model.lm is None and not model.lm_reading:
            model.lm_reading = True
            self.reads.append((model.name, model.spec.hf))

    def drain_reads(self) -> list[tuple[str, str]]:
        reads, self.reads = self.reads, []
        return reads

    def files_read(self, name: str, hf: str, files: LmFiles, now: float) -> None:
        """The shell read `hf` for model `name` (on a thread): keep it, then take the calls
        that waited for it, as if they came now but with their own arrival times."""
        model = self.models.get(name)
        if model is None or model.spec.hf != hf or model.lm is not None:
            return  # undeployed (or deployed again) meanwhile: that read is for nobody
        model.lm, model.lm_reading = files, False
        if files.error is not None:
            log.info("model=%s does not generate: %s", name, files.error.reason)
        gm = self.by_model.get(name)
        if gm is None or gm.model is not model:
            return
        held, gm.held = gm.held, []
        for addr, msg, arrived in held:
            try:
                if isinstance(msg, p.Generate):
                    self.generate(addr, msg, now, arrived)
                elif isinstance(msg, p.TokenizerInfo):
                    self.tokenizer_info(addr, msg, now)
            except FlowmeshError as exc:
                self.ctx.to_client(addr, p.error_for(exc, msg.id))
        self.pump(now)

    def tick(self, now: float) -> None:
        """Calls past their deadline are answered TIMEOUT; the files of every ready model from
        a directory are read ahead of its first call."""
        for model in self.models.values():
            if model.state is ModelState.READY:
                self.want_files(model)
        for gm in list(self.by_model.values()):
            late = [(a, m, t) for a, m, t in gm.held if t + self._timeout(m) <= now]
            for item in late:
                gm.held.remove(item)
                addr, msg, arrived = item
                reason = f"{gm.model.name!r}: its files were not read within {now - arrived:.1f} s"
                self.ctx.to_client(addr, p.Error(id=msg.id, code=str(Code.TIMEOUT), reason=reason))
            for call in [c for c in gm.calls.values() if c.deadline <= now]:
                ended = sum(s.finish is not None for s in call.seqs)
                waited = any(s in gm.waiting for s in call.seqs) and gm.room_wait
                self._fail_call(
                    call,
                    Code.TIMEOUT,
                    f"generation not finished within {call.deadline - call.arrived:.1f} s "
                    f"({ended} of {len(call.seqs)} sequences ended)"
                    + (f"; waiting for {gm.room_wait}" if waited else ""),
                )
        self.probe_clients(now)
        self.pump(now)

    def probe_clients(self, now: float) -> None:
        """A heartbeat to each client with a call running for CLIENT_PROBE_S since it came or
        was last probed (checked at each tick): one the ROUTER cannot deliver (the client is
        gone) stops its calls (`clients_gone`), as an undeliverable chunk stops a stream."""
        calls = self.calls.values()
        due = {c.client for c in calls if now - max(c.arrived, c.probed) >= CLIENT_PROBE_S}
        for call in self.calls.values():
            if call.client in due:
                call.probed = now
        for addr in due:
            self.ctx.to_client(addr, p.Heartbeat())

    def clients_gone(self, addr: bytes, now: float) -> None:
        """A heartbeat could not reach client `addr`: each of its calls ends as `client_gone`
        ends one."""
        for client, client_id in [k for k in self.calls if k[0] == addr]:
            self.client_gone(client, client_id, now)

    def _timeout(self, msg: p.Generate | p.TokenizerInfo) -> float:
        ms = getattr(msg, "timeout_ms", None)
        return ms / 1000 if ms else self.cfg.default_timeout_s

    # ================================================================== scheduling

    def pump(self, now: float) -> None:
        """Start an iteration on every replica that has sequences to run and none in flight;
        a model being undeployed whose generations have all ended goes on with its undeploy."""
        drained: list[Model] = []
        for name, gm in list(self.by_model.items()):
            model = self.models.get(name)
            if model is not gm.model:  # undeployed (perhaps deployed again)
                del self.by_model[name]
                reason = f"{name!r} was undeployed"
                if gm.model.drain is not None:
                    d = gm.model.drain
                    reason += f" after waiting {d.until - d.since:.1f} s for its generations to end"
                for call in list(gm.calls.values()):
                    self._fail_call(call, Code.MODEL_NOT_FOUND, reason)
                # Calls still waiting for its files: nobody else would answer them (the read,
                # when it ends, is for nobody; `tick` looks only at models still here).
                held, gm.held = gm.held, []
                for addr, msg, _ in held:
                    self.ctx.to_client(
                        addr, p.Error(id=msg.id, code=str(Code.MODEL_NOT_FOUND), reason=reason)
                    )
                continue
            if model.drain is not None and not gm.calls and not gm.held:
                drained.append(model)
                continue
            if gm.room_seq is not None and gm.room_seq.finish is not None:
                # The sequence that waited for room ended (answered, timed out, stopped).
                gm.room_wait, gm.room_seq, gm.retry_at = "", None, 0.0
            if not gm.calls:
                continue
            for g in [g for g in gm.reps if not self._usable(model, g)]:
                # Its replica went (given up after a hang): what ran there is lost.
                gm.reps.remove(g)
                for call in {id(s.call): s.call for s in g.running()}.values():
                    self._fail_call(
                        call, Code.WORKER_LOST, f"the replica of {name!r} it ran on was removed"
                    )
                self._free(gm, g.rep, g.running())
            starving = bool(gm.waiting) and (
                now - gm.waiting[0].call.arrived >= self.cfg.starvation_s
            )
            for g in list(gm.reps):
                self._iterate(gm, g, now, starving)
            # Sequences that no replica in use has room for: open one more replica.
            while (
                gm.waiting
                and now >= gm.retry_at
                and not any(self._has_room(gm, g) for g in gm.reps)
            ):
                rep = self.router.pick_gen(model, [g.rep for g in gm.reps], now, starving=starving)
                if rep is None:
                    break
                stages = len(rep.workers)
                n = min(stages, self.cfg.gen_groups or stages)
                g = GenRep(rep, [Group() for _ in range(max(1, n))])
                gm.reps.append(g)
                self._iterate(gm, g, now, starving, ensured=True)
                if g not in gm.reps:
                    break  # none of them could join it now (waiting for their parked KV)
        for model in drained:
            self.on_drained(model, now)

    @staticmethod
    def _usable(model: Model, g: GenRep) -> bool:
        return g.busy() or any(r is g.rep for r in model.replicas)

    @staticmethod
    def _awaiting_park(s: Seq, g: GenRep, now: float) -> bool:
        """Whether `s`, parked on `g`'s replica, waits for its workers' answers before it joins
        (it then resumes from its KV; past PARK_WAIT_S it is recomputed instead)."""
        return (
            s.parked > 0
            and s.parked_rep is g.rep
            and len(s.parked_ok) < len(g.rep.workers)
            and now - s.parked_at < PARK_WAIT_S
        )

    def _has_room(self, gm: GenModel, g: GenRep) -> bool:
        return not g.hold and not g.rep.draining and len(g.running()) < gm.model.spec.max_seqs

    def _iterate(
        self, gm: GenModel, g: GenRep, now: float, starving: bool, ensured: bool = False
    ) -> None:
        """Start an iteration for every group of `g` that has sequences to run and none in
        flight, waiting sequences joining the idle groups first."""
        idle = [k for k in g.groups if k.batch is None]
        if not idle:
            return
        model = gm.model
        admit: list[tuple[Seq, Group]] = []
        # (A draining replica takes no new sequence: it is dropped once its own have ended.)
        if not g.hold and now >= gm.retry_at and not g.rep.draining:
            room = model.spec.max_seqs - len(g.running())
            if g.solo:
                # Alone: nothing else may be in flight beside it (it is the verdict on it).
                room = 0 if g.busy() else min(room, 1)
            sizes = {id(k): len(k.running) for k in idle}
            later: list[Seq] = []
            while gm.waiting and len(admit) < room:
                s = gm.waiting.popleft()
                if self._awaiting_park(s, g, now):
                    later.append(s)
                    continue
                # The smallest idle group (the first of equals: `min` keeps the first).
                k = min(idle, key=lambda k: sizes[id(k)])
                admit.append((s, k))
                sizes[id(k)] += 1
            gm.waiting.extendleft(reversed(later))
        ready = [k for k in idle if k.running or any(j is k for _, j in admit)]
        if not ready:
            # Nothing on it: free for other models' stages, but while its `solo` verdict has
            # sequences waiting to act on it (for their parked KV's answers, or for room): a
            # GenRep made again would not know it and take them all at once again, the very
            # iteration refused, resent as soon as they may join (a livelock).
            pending = g.solo and bool(gm.waiting) and not g.rep.draining
            if not g.busy() and not g.running() and not pending:
                gm.reps.remove(g)
            return
        for n, k in enumerate(ready):
            # Each group's iteration is a run of its own on the replica's workers: it may
            # start only when the replica may take one more (`ensured`: the first may).
            if not (ensured and n == 0) and not self.router.ensure_gen(
                model, g.rep, now, starving=starving
            ):
                # Not now: the sequences of the groups left wait again, in their order.
                gm.waiting.extendleft(reversed([s for s, j in admit if j in ready[n:]]))
                return
            for s, j in admit:
                if j is k:
                    s.rep, s.group = g, k
                    k.running.append(s)
            # Starved of KV room beside other models: their live stages may go for it.
            starved = bool(gm.room_wait) and now - gm.room_since >= self.cfg.starvation_s
            self._start(gm, g, k, now, evict_live=starved)

    def _start(
        self, gm: GenModel, g: GenRep, k: Group, now: float, *, evict_live: bool = False
    ) -> None:
        """Send group `k`'s next iteration: every running sequence of it, packed in one Run."""
        steps, ids, prefill, resume = [], [], [], []
        for s in k.running:
            kind = ""
            if s.prefilled:
                start, new = len(s.prompt) + len(s.out) - 1, [s.out[-1]]
            elif s.parked and s.parked_rep is g.rep and len(s.parked_ok) == len(g.rep.workers):
                # Every stage kept its KV: it goes on from there (the workers copy it back).
                start, kind = s.parked, "swap"
                new = (s.prompt + s.out)[start:]
            else:
                # Its whole prompt, and after a preemption the tokens it had drawn too: their
                # keys and values recomputed, its next token drawn from the last of them.
                self._unpark(s)
                start, new = 0, s.prompt + s.out
                kind = "recompute" if s.preempted else ""
            steps.append(
                p.SeqStep(
                    seq=s.id,
                    start=start,
                    count=len(new),
                    sampling=s.call.sampling,
                    drawn=len(s.out),
                )
            )
            ids.extend(new)
            prefill.append(not s.prefilled)
            resume.append(kind)
            s.sent = True
        step = p.GenStep(seqs=steps, evict_live=evict_live and any(prefill))
        it = Iteration(step, list(k.running), prefill, gm.frees, resume)
        tensor = p.TensorRef("int64", (len(ids),), numpy.asarray(ids, dtype="<i8").tobytes())
        k.batch = self.router.start_gen(gm.model, g.rep, it, tensor, now)
        gm.iterations += 1
        self._follow(gm, g, k, now)

    def _follow(self, gm: GenModel, g: GenRep, k: Group, now: float) -> None:
        """On a replica of one stage, send group `k`'s next iteration now, to follow the one in
        flight on the worker (`GenStep.follows`: each sequence's token is the one that one
        draws, taken in there). The worker starts it as soon as that one is done, with no round
        trip to the broker between two tokens (SGLang's and vLLM's overlap scheduling). Not
        when sequences wait that could join the group (they join at its next iteration sent
        from here), nor for a sequence whose last token is the one in flight; a sequence that
        draws a stop token in flight has one token drawn after it that is never taken."""
        pred = k.batch
        if (
            not self.cfg.gen_overlap
            or pred is None
            or k.ahead is not None
            or k.deferred is not None
            or len(g.rep.workers) != 1
            or (gm.waiting and self._has_room(gm, g))
            or not self.router.may_follow(gm.model, g.rep)
        ):
            return
        it: Iteration = pred.gen
        steps, seqs = [], []
        for s, step in zip(it.seqs, it.step.seqs, strict=True):
            if s.finish is not None or step.drawn + 1 >= s.max_new:
                continue
            steps.append(
                p.SeqStep(
                    seq=s.id,
                    start=step.start + step.count,
                    count=1,
                    sampling=step.sampling,
                    drawn=step.drawn + 1,
                )
            )
            seqs.append(s)
        if not steps:
            return
        ahead = Iteration(
            p.GenStep(seqs=steps, follows=pred.run_id),
            seqs,
            [False] * len(seqs),
            gm.frees,
            [""] * len(seqs),
        )
        zeros = p.TensorRef("int64", (len(steps),), bytes(8 * len(steps)))
        k.ahead = self.router.start_gen(gm.model, g.rep, ahead, zeros, now)
        gm.iterations += 1
        gm.follows += 1

    # ================================================================== results

    def running_calls(self, model: Model) -> int:
        """The generation calls `model` has running, waiting to join, or waiting for its
        files."""
        gm = self.by_model.get(model.name)
        if gm is None or gm.model is not model:
            return 0
        return len(gm.calls) + len(gm.held)

    def holds(self, model: Model, rep: Replica) -> bool:
        """Whether live sequences of `model` keep KV on `rep`'s workers."""
        gm = self.by_model.get(model.name)
        return gm is not None and any(g.rep is rep and g.running() for g in gm.reps)

    def waits(self, model: Model) -> bool:
        gm = self.by_model.get(model.name)
        return gm is not None and bool(gm.waiting)

    def _owner(self, batch: Batch) -> tuple[GenModel, GenRep, Group] | None:
        gm = self.by_model.get(batch.model)
        if gm is None:
            return None
        found = (
            (g, k) for g in gm.reps for k in g.groups if k.batch is batch or k.ahead is batch
        )
        g, k = next(found, (None, None))
        return None if g is None or k is None else (gm, g, k)

    def iteration_done(self, batch: Batch, tensors: list[dict[str, Any]], now: float) -> None:
        owner = self._owner(batch)
        if owner is None:
            return
        gm, g, k = owner
        if self._out_of_turn(gm, g, k, batch, now):
            return
        it: Iteration = batch.gen
        try:
            tokens = self._tokens(tensors, len(it.seqs), gm.model)
        except FlowmeshError as exc:
            why = f"worker {batch.worker} answered generation badly: {exc.reason}"
            log.warning("%s", why)
            self.iteration_failed(batch, str(Code.INTERNAL), why, now)
            return
        k.batch, ahead, k.ahead = None, k.ahead, None
        g.solo = False
        if any(it.prefill):
            gm.room_wait, gm.room_seq = "", None  # its sequences found room
        ended: list[Seq] = []
        timings, name = self.router.timings, gm.model.name
        drawn = 0
        for s, tok, kind in zip(it.seqs, tokens, it.resume, strict=True):
            s.prefilled = True
            if kind:
                s.preempted = False
                self._unpark(s, tell=False)  # copied back: the workers hold it as any other
                if kind == "swap":
                    gm.swaps += 1
                else:
                    gm.recomputes += 1
            if s.finish is not None:  # stopped, or its call failed, while this ran
                ended.append(s)
                continue
            # Timed by the clock the room is handed (`now`), as the Generated's timings are.
            if s.times:
                timings.next_token(name, now - s.times[-1])
            else:
                timings.first_token(name, now - s.call.arrived)
            s.out.append(tok)
            s.times.append(now)
            gm.tokens += 1
            drawn += 1
            if tok in s.stops:
                s.finish = "stop"
            elif len(s.out) >= s.max_new:
                s.finish = "length"
            if s.call.stream:
                chunk = p.GenChunk(id=s.call.client_id, index=s.index, ids=[tok], finish=s.finish)
                self.ctx.to_client(s.call.client, chunk)
            if s.finish is not None:
                ended.append(s)
        if drawn:
            gm.token_rate.add(now, drawn)
        held = {id(s) for s in ahead.gen.seqs} if ahead is not None else set()
        if ended:
            k.running = [s for s in k.running if s.finish is None]
            # One that the follower holds too is freed once that one is back.
            self._free(gm, g.rep, [s for s in ended if id(s) not in held])
        if ahead is not None:
            k.batch = ahead
            self._follow(gm, g, k, now)
        for call in {id(s.call): s.call for s in ended}.values():
            self._maybe_done(call, now)

    @staticmethod
    def _tokens(parts: list[dict[str, Any]], n: int, model: Model) -> list[int]:
        """The last stage's new tokens: one part, one tensor 'tokens', int64, one per sequence,
        inside the vocabulary."""
        ref = parts[0].get("tokens") if len(parts) == 1 else None
        if ref is None or len(parts[0]) != 1:
            got = [sorted(part) for part in parts]
            raise fail(Code.BAD_REQUEST, f"expected one part of one tensor 'tokens', got {got}")
        if ref.dtype != "int64" or tuple(ref.shape) != (n,):
            raise fail(
                Code.BAD_REQUEST,
                f"tokens: expected int64 [{n}], got {ref.dtype} {list(ref.shape)}",
            )
        buf = ref.frame.buffer if hasattr(ref.frame, "buffer") else memoryview(ref.frame)
        values = [int(v) for v in numpy.frombuffer(buf, dtype="<i8", count=n)]
        files: LmFiles | None = model.lm
        top = files.vocab_size if files is not None and files.vocab_size else p.TOKEN_ID_LIMIT
        bad = [v for v in values if not 0 <= v < top]
        if bad:
            raise fail(Code.BAD_REQUEST, f"token {bad[0]} is outside the vocabulary (0..{top - 1})")
        return values

    def iteration_failed(self, batch: Batch, code: str, reason: str, now: float) -> None:
        owner = self._owner(batch)
        if owner is None:
            return
        gm, g, k = owner
        if self._out_of_turn(gm, g, k, batch, now):
            return
        if k.ahead is not None:
            k.deferred = (batch.gen, code, reason)
            k.batch, k.ahead = k.ahead, None
            return
        k.batch = None
        self._failed(gm, g, k, batch.gen, code, reason, now)

    def _out_of_turn(self, gm: GenModel, g: GenRep, k: Group, batch: Batch, now: float) -> bool:
        """Whether `batch`'s answer (a result or an error) is not taken as its iteration's: a
        follower answered before the iteration it follows (refused as it was placed, or out of
        order): dropped, that one's answer decides and the next iteration is sent from here as
        without a follower (one computing its token again, over the same positions of the KV);
        or the follower of an iteration that failed, whose failure is dealt with now."""
        if batch is k.ahead:
            k.ahead = None
            return True
        if k.deferred is not None:
            it, code, reason = k.deferred
            k.batch, k.deferred = None, None
            self._failed(gm, g, k, it, code, reason, now)
            return True
        return False

    def _failed(
        self, gm: GenModel, g: GenRep, k: Group, it: Iteration, code: str, reason: str, now: float
    ) -> None:
        """Group `k`'s iteration `it` failed with `code` (nothing of it in flight any more)."""
        # Stopped while it ran (also one its follower held after it drew its last token).
        ended = [s for s in {id(s): s for s in [*k.running, *it.seqs]}.values() if s.finish]
        if ended:
            k.running = [s for s in k.running if s.finish is None]
            self._free(gm, g.rep, ended)
        if code == Code.NOT_RESIDENT:
            # The stage was evicted (or could not be brought back for the run), or holds no KV
            # of a sequence: the prefills run again as they were, through a Load (the next
            # pump). A decode is preempted: a worker that evicted the stage parked its live
            # sequences' KV where that paid, and the other stages still hold theirs, so each
            # stage is told to park it (`_park`); it resumes from that KV where every stage
            # kept it (answered `SeqsParked`), else from its tokens. Freeing it instead threw
            # away the KV that the evicting worker had just parked.
            for s, kind in zip(it.seqs, it.resume, strict=True):
                if kind == "swap":  # a stage lost its parked KV: recompute it instead
                    self._unpark(s)
            lost = [
                s
                for s, pre in zip(it.seqs, it.prefill, strict=True)
                if not pre and s.finish is None
            ]
            k.running = [s for s in k.running if s not in lost]
            self._park(gm, g.rep, lost, now)
            for s in reversed(lost):
                s.rep, s.group, s.prefilled = None, None, False
                gm.waiting.appendleft(s)
            gm.preemptions += len(lost)
            return
        if code == Code.NO_SPACE:
            self._no_space(gm, g, k, it, reason, now)
            return
        if code == Code.TOO_BIG:
            self._too_big_in_group(gm, g, k, it, reason, now)
            return
        # Only this group's calls: the other groups' iterations are runs of their own.
        for call in {id(s.call): s.call for s in it.seqs}.values():
            self._fail_call(call, code, reason)

    def _no_space(
        self, gm: GenModel, g: GenRep, k: Group, it: Iteration, reason: str, now: float
    ) -> None:
        """A stage could not place KV blocks for group `k`'s iteration (the other groups'
        sequences hold KV on the same workers: they count as running beside it)."""
        prefills = [s for s, pre in zip(it.seqs, it.prefill, strict=True) if pre]
        others = [s for s, pre in zip(it.seqs, it.prefill, strict=True) if not pre]
        beside = [s for j in g.groups if j is not k for s in j.running]
        live = [s for s in prefills if s.finish is None]
        # Sequences freed while it ran held the memory it found full: no verdict on it alone.
        freed = gm.frees != it.frees
        if not prefills:
            # Decodes alone: the sequences outgrew the memory. The group's newest one is
            # preempted: its blocks freed (its KV parked where that pays, `_park`), it waits
            # at the head of the queue with the tokens it has, and joins again when memory
            # frees. Alone on the replica it could never fit: TOO_BIG.
            if len(k.running) < len(it.seqs):
                return  # some of it ended while it ran: their memory is free, run again
            s = k.running[-1]
            if len(k.running) == 1 and not beside:
                if freed:
                    return
                if not self._beside(gm, g):
                    self._too_big_alone(gm, s, reason, now)
                    return
                # Other models hold the room: it waits for theirs to free (`_wait_for_room`).
            k.running.remove(s)
            self._park(gm, g.rep, [s], now)
            s.rep, s.group, s.prefilled = None, None, False
            gm.waiting.appendleft(s)
            gm.preemptions += 1
            g.hold = True
            log.info("model=%s seq=%d preempted after %d tokens: %s", gm.model.name, s.id,
                     len(s.out), reason)  # fmt: skip
            if len(k.running) == 0 and not beside:
                self._wait_for_room(gm, g, s, reason, now)
            return
        alone = len(prefills) == 1 and not others and not beside and live and not freed
        # (A prefill stopped while it ran says nothing of whether it fits: no verdict.)
        if alone and not self._beside(gm, g):
            self._too_big_alone(gm, prefills[0], reason, now)
            return
        # The prefills wait again (their blocks freed on every stage; a resumed one's KV parked
        # again); the decodes run on. What that frees is only what this try took: no model
        # waiting for room is woken by it (two waiting models would wake each other at once).
        k.running = [s for s in k.running if s not in prefills]
        resumed = [s for s, kind in zip(it.seqs, it.resume, strict=True) if kind == "swap"]
        self._park(gm, g.rep, resumed, now, wake=False)
        self._free(gm, g.rep, [s for s in prefills if s not in resumed], wake=False)
        for s in reversed(live):
            s.rep, s.group, s.prefilled = None, None, False
            gm.waiting.appendleft(s)
        if others or beside:
            g.hold = True
        else:
            g.solo = True
        if alone:
            self._wait_for_room(gm, g, prefills[0], reason, now)

    def _too_big_in_group(
        self, gm: GenModel, g: GenRep, k: Group, it: Iteration, reason: str, now: float
    ) -> None:
        """A stage refused group `k`'s iteration `it` TOO_BIG: the KV of its longest sequence
        could never fit the model's share of that stage's worker, whatever is freed there (the
        worker measures the longest step, having placed nothing: `Executor._place_kv`). The
        calls of the sequences that long fail; the iteration's other prefills wait again (freed
        where they were placed, a resumed one parked again) and its decodes run on, as after
        NO_SPACE: one call too long for the stages does not fail those batched with it."""
        top = max(step.start + step.count for step in it.step.seqs)
        at_fault = {
            id(s.call): s
            for s, step in zip(it.seqs, it.step.seqs, strict=True)
            if step.start + step.count == top
        }
        for s in at_fault.values():
            self._fail_call(s.call, Code.TOO_BIG, self._too_big(gm, s, reason, alone=True))
        prefills = [s for s, pre in zip(it.seqs, it.prefill, strict=True) if pre and not s.finish]
        k.running = [s for s in k.running if s not in prefills]
        resumed = [s for s, kind in zip(it.seqs, it.resume, strict=True) if kind == "swap"]
        resumed = [s for s in resumed if s in prefills]
        self._park(gm, g.rep, resumed, now, wake=False)
        self._free(gm, g.rep, [s for s in prefills if s not in resumed], wake=False)
        for s in reversed(prefills):
            s.rep, s.group, s.prefilled = None, None, False
            gm.waiting.appendleft(s)

    def _beside(self, gm: GenModel, g: GenRep) -> list[str]:
        """The other models resident on `g`'s workers, and the training on those that train
        (its tasks borrow serving's free memory, and give it back once a placement claims it:
        `gpu_worker.memory`): what may hold the KV room a sequence of `gm` found missing with
        nothing else of its model running."""
        peers = [peer for w in g.rep.workers if (peer := self.peers.get(w)) is not None]
        models = {key[0] for peer in peers for key in peer.resident if key[0] != gm.model.name}
        training = [f"training on {peer.name}" for peer in peers if train_bytes_of(peer) > 0]
        return sorted(models) + training

    def _too_big_alone(self, gm: GenModel, s: Seq, reason: str, now: float) -> None:
        """`s` found no KV room with nothing else of its model running and nothing but its
        model resident on its workers: it could never fit. One whose call set no max_tokens
        (None: until the context is full) and that has new tokens ends there instead, "length":
        the KV memory of its replica is as far as its context goes."""
        if s.call.sampling.max_tokens is None and s.out:
            log.info("model=%s seq=%d ends after %d tokens, its KV memory full: %s",
                     gm.model.name, s.id, len(s.out), reason)  # fmt: skip
            self._end(s, "length")
            self._maybe_done(s.call, now)
            return
        self._fail_call(s.call, Code.TOO_BIG, self._too_big(gm, s, reason, alone=True))

    def _wait_for_room(self, gm: GenModel, g: GenRep, s: Seq, reason: str, now: float) -> None:
        """Sequence `s` of `gm`, alone on its replica, found no KV room: other models' stages
        and sequences hold it. It waits at the head of the queue (its call's deadline bounds
        the wait): no sequence of the model joins until one of any model frees memory or
        KV_RETRY_S passes (room may come from elsewhere: a stage evicted, training giving
        memory back); once it has waited past the starvation limit, its tries may evict stages
        holding other models' live sequences (`GenStep.evict_live`)."""
        beside = ", ".join(map(repr, self._beside(gm, g)))
        if not gm.room_wait or gm.room_seq is not s:
            log.info("model=%s waits for KV room beside %s: %s", gm.model.name, beside, reason)
            gm.room_seq, gm.room_since = s, now
        gm.room_wait = f"no KV room beside {beside} on the same workers: {reason}"
        gm.retry_at = now + KV_RETRY_S
        gm.room_waits += 1

    @staticmethod
    def _too_big(gm: GenModel, s: Seq, reason: str, *, alone: bool) -> str:
        n = len(s.prompt) + s.max_new
        where = "even alone" if alone else "beside the other running sequences"
        return (
            f"a sequence of {len(s.prompt)} prompt tokens + {s.max_new} new "
            f"({n}) does not fit the KV memory of {gm.model.name!r}'s stages {where}: {reason}"
        )

    def replica_lost(self, model: Model, rep: Replica, lost: str, now: float) -> None:
        """`rep` lost worker `lost`: its sequences' KV went with it. They start again, from
        their tokens, on another replica (waiting at the head of the queue, as a preempted
        sequence does); with no live replica left, their calls fail WORKER_LOST."""
        gm = self.by_model.get(model.name)
        if gm is None:
            return
        again = self._leave(gm, rep, skip=lost)
        if again:
            log.info(
                "model=%s worker=%s lost: %d sequences start again elsewhere",
                model.name, lost, again,
            )  # fmt: skip
        if not model.replicas:
            reason = f"worker {lost} was lost and {model.name!r} has no live replica left"
            for call in {id(s.call): s.call for s in gm.waiting}.values():
                self._fail_call(call, Code.WORKER_LOST, reason)

    def replica_given_up(self, batch: Batch, code: str, reason: str, now: float) -> None:
        """A run of `batch.replica` hung (`ServingRouter.run_hung`) and the replica was given
        up, its worker still heartbeating. The calls of the iteration that hung (`batch`, when
        it is one of a group's) fail with `code`; the sequences of the replica's other groups,
        running or idle, start again from their tokens as those of a lost replica do
        (`replica_lost`): their KV there is gone or untrusted, freed on every worker still
        here. With no live replica left, their calls fail WORKER_LOST."""
        gm = self.by_model.get(batch.model)
        rep = batch.replica
        if gm is None or not (
            any(g.rep is rep for g in gm.reps) or any(s.parked_rep is rep for s in gm.waiting)
        ):
            return  # nothing of it there (given up already: a late run of it hung too)
        owner = self._owner(batch)
        hung = {id(s.call): s.call for s in batch.gen.seqs} if owner is not None else {}
        for g in [g for g in gm.reps if g.rep is rep]:
            for k in g.groups:
                if k.deferred is not None:  # an earlier failure waiting for this follower
                    it, why_code, why = k.deferred
                    k.batch, k.ahead, k.deferred = None, None, None
                    self._failed(gm, g, k, it, why_code, why, now)
        again = self._leave(gm, rep, failing=frozenset(hung))
        for call in hung.values():
            self._fail_call(call, code, reason)
        if again:
            log.info(
                "model=%s replica given up (a run hung on worker %s): %d sequences start again",
                batch.model, batch.worker, again,
            )  # fmt: skip
        model = self.models.get(batch.model)
        if model is gm.model and not model.replicas:
            why = (
                f"a run hung on worker {batch.worker} and {batch.model!r} has no live replica left"
            )
            for call in {id(s.call): s.call for s in gm.waiting}.values():
                self._fail_call(call, Code.WORKER_LOST, why)

    def _leave(
        self, gm: GenModel, rep: Replica, *, skip: str = "", failing: frozenset[int] = frozenset()
    ) -> int:
        """Every sequence of `rep` leaves it (every group's: their KV was on the same
        workers), freed on its workers but `skip`, parked copies there too; the live ones,
        but those of the calls in `failing` (by id), start again from their tokens at the
        head of the queue. How many start again."""
        for s in gm.waiting:
            if s.parked_rep is rep:  # its parked KV went with the replica, on a stage at least
                self._unpark(s, skip=skip)
        restarted = 0
        for g in [g for g in gm.reps if g.rep is rep]:
            gm.reps.remove(g)
            running = g.running()
            for k in g.groups:
                k.batch, k.ahead, k.deferred, k.running = None, None, None, []
            self._free(gm, rep, running, skip=skip)
            again = [s for s in running if s.finish is None and id(s.call) not in failing]
            for s in reversed(again):
                s.rep, s.group, s.prefilled = None, None, False
                gm.waiting.appendleft(s)
            gm.restarts += len(again)
            restarted += len(again)
        return restarted

    # ================================================================== ending

    def _end(self, s: Seq, finish: str) -> None:
        """End `s` between its tokens (`finish`, told in a last empty chunk to a stream) and
        drop it; its call is answered by `_maybe_done` once all of its sequences ended."""
        s.finish = finish
        if s.call.stream:
            chunk = p.GenChunk(id=s.call.client_id, index=s.index, ids=[], finish=finish)
            self.ctx.to_client(s.call.client, chunk)
        self._drop(s)

    def _drop(self, s: Seq) -> None:
        """Take an ended sequence out of the model's tables; free its KV (parked copies too)
        unless an iteration holding it runs: its return frees it. That holds for the parked
        copies of one resuming from them in that iteration: a stage it has not reached yet
        copies them back as it comes, and would find nothing."""
        gm = s.call.gm
        if s in gm.waiting:
            self._unpark(s)
            gm.waiting.remove(s)
            return
        g, k = s.rep, s.group
        if g is None or k is None or s not in k.running:
            self._unpark(s)
            return
        if k.batch is not None:
            return  # `iteration_done` / `_failed` free it (and forget its parked KV)
        k.running.remove(s)
        self._free(gm, g.rep, [s])  # its parked copies there too
        self._unpark(s)  # copies its FreeSeqs did not reach (it was not sent since)

    def _free(
        self, gm: GenModel, rep: Replica, seqs: list[Seq], skip: str = "", *, wake: bool = True
    ) -> None:
        """FreeSeqs for `seqs` to each stage's worker (which drops their KV held or parked
        there: parked copies on `rep` are forgotten with it); a freed sequence lets waiting
        prefills of the model try again."""
        ids = [s.id for s in seqs if s.sent]
        for s in seqs:
            if s.sent and s.parked_rep is rep:
                self._unpark(s, tell=False)
            s.sent = False
        if not ids:
            return
        self._tell_free(gm, rep, ids, skip=skip, wake=wake)

    def _tell_free(
        self,
        gm: GenModel,
        rep: Replica,
        ids: list[int],
        *,
        park: bool = False,
        skip: str = "",
        wake: bool = True,
    ) -> None:
        """FreeSeqs (parking where `park`) to each stage's worker of `rep` but `skip`; the
        model's replicas stop holding back their prefills, which may now fit, and (`wake`:
        memory was freed, not only what a refused try had just taken) every model waiting
        for room tries again."""
        gm.frees += 1
        for stage, w in enumerate(rep.workers):
            if w != skip and w in self.peers:
                msg = p.FreeSeqs(model=gm.model.name, stage=stage, seqs=ids, park=park)
                self.ctx.to_peer(w, msg)
        for g in gm.reps:
            g.hold = False
        if wake:
            for other in self.by_model.values():
                other.retry_at = 0.0

    def _park(
        self, gm: GenModel, rep: Replica, seqs: list[Seq], now: float, *, wake: bool = True
    ) -> None:
        """Preempt `seqs`: their stages' workers free their blocks, each keeping a sequence's KV
        in host memory where that costs less than recomputing it (one `FreeSeqs` with park a
        stage, answered `SeqsParked`); freed sequences let waiting prefills try again."""
        if not seqs:
            return
        for s in seqs:
            s.parked, s.parked_rep, s.parked_ok = len(s.prompt) + len(s.out) - 1, rep, set()
            s.parked_at = now
            s.preempted, s.sent = True, False
            self.parked[s.id] = s
        self._tell_free(gm, rep, [s.id for s in seqs], park=True, wake=wake)

    def _unpark(self, s: Seq, *, tell: bool = True, skip: str = "") -> None:
        """Forget `s`'s parked KV; `tell`: its workers (but `skip`) drop their copies too."""
        if self.parked.pop(s.id, None) is None or s.parked_rep is None:
            return
        if tell:
            for stage, w in enumerate(s.parked_rep.workers):
                if w != skip and w in self.peers:
                    msg = p.FreeSeqs(model=s.call.model, stage=stage, seqs=[s.id])
                    self.ctx.to_peer(w, msg)
        s.parked, s.parked_rep, s.parked_ok = 0, None, set()

    def seqs_parked(self, peer_name: str, msg: p.SeqsParked, now: float) -> None:
        """A stage's worker parked some of the preempted sequences and dropped the others: a
        sequence every stage parked may resume from its KV; one any stage dropped is
        recomputed (the others' copies dropped at once)."""
        for sid in msg.parked:
            s = self.parked.get(sid)
            rep = s.parked_rep if s is not None else None
            # (Not a late answer from the workers of a replica it was parked on before.)
            if (
                rep is not None
                and msg.stage < len(rep.workers)
                and rep.workers[msg.stage] == peer_name
            ):
                s.parked_ok.add(msg.stage)  # type: ignore[union-attr]
        for sid in msg.dropped:
            s = self.parked.get(sid)
            if s is not None:
                self._unpark(s)
        self.pump(now)  # a sequence that waited for these answers may join now

    def _maybe_done(self, call: Call, now: float) -> None:
        if call.answered or any(s.finish is None for s in call.seqs):
            return
        outputs = []
        for s in call.seqs:
            times = s.times
            outputs.append(
                p.GenOutput(
                    ids=list(s.out),
                    finish=s.finish or "stop",
                    prompt_tokens=len(s.prompt),
                    ttft_ms=(times[0] - call.arrived) * 1000 if times else 0.0,
                    token_ms=[(b - a) * 1000 for a, b in itertools.pairwise(times)],
                )
            )
        self._close(call)
        self.ctx.to_client(call.client, p.Generated(id=call.client_id, outputs=outputs))
        model = self.models.get(call.model)
        if model is not None:
            model.completed += 1
        self.ctx.totals["completed"] += 1

    def _fail_call(self, call: Call, code: Code | str, reason: str) -> None:
        """Answer `call` with an error once; its sequences end and free their memory."""
        if call.answered:
            return
        for s in call.seqs:
            if s.finish is None:
                s.finish = "error"
            self._drop(s)
        self._close(call)
        self.ctx.to_client(call.client, p.Error(id=call.client_id, code=str(code), reason=reason))
        model = self.models.get(call.model)
        if model is not None:
            model.errors += 1
            model.errors_by_code[str(code)] = model.errors_by_code.get(str(code), 0) + 1
        self.ctx.totals["errors"] += 1

    def _close(self, call: Call) -> None:
        call.answered = True
        call.gm.calls.pop((call.client, call.client_id), None)
        self.calls.pop((call.client, call.client_id), None)
        self.ctx.client_done(call.client)

    # ================================================================== status

    def figures(self, name: str) -> GenFigures:
        gm = self.by_model.get(name)
        if gm is None or self.models.get(name) is not gm.model:
            return GenFigures()
        return GenFigures(
            gm.running(),
            len(gm.waiting),
            gm.tokens,
            gm.iterations,
            gm.preemptions,
            gm.restarts,
            gm.token_rate.value,  # as of the model's last token (as `rate_per_s` is)
            swaps=gm.swaps,
            recomputes=gm.recomputes,
            **self.router.timings.token_quantiles(name),
        )
