"""The Python SDK: `AsyncClient` (asyncio) and `Client` (blocking), both over one connection to
the broker (`client_sdk.connection`: its socket, the calls' ids and answers, the broker's limits,
and what happens when the broker is missing or goes away).

Every call waits for its own `timeout` when given, else for the client's (`timeout=`, 60 s by
default); the calls whose `timeout` defaults to None (infer, status, jobs, undeploy, the training
steps) take the client's. Deploy, plan, training open and sweeps name their own, longer defaults.
A client that reaches no broker fails its first call within `connect_timeout` (5 s by default)
with UNAVAILABLE, naming the address.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar, overload

import msgspec

from client_sdk.connection import (
    CONNECT_TIMEOUT_S,
    Connection,
    client_keys,
    is_tensor,
    sendable,
)
from client_sdk.generation import (
    AsyncGenStream,
    Codecs,
    GenAsk,
    Generation,
    blocking_stream,
)
from client_sdk.generation import generate as generate_async
from client_sdk.jobs import AsyncJob, Job
from client_sdk.loop_thread import LoopThread
from client_sdk.sweep import sweep_async
from flowmesh import protocol as p
from flowmesh.auth import CurveKeys

if TYPE_CHECKING:  # for annotations only: a caller with tensors has imported torch itself
    import torch

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")

DEFAULT_ADDRESS = os.environ.get("FLOWMESH_BROKER", "tcp://127.0.0.1:5555")


class AsyncClient:
    """Asynchronous client. Create and use it inside one running event loop.

    `timeout`: the seconds a call waits when it gives none of its own (see the module's
    docstring); `connect_timeout`: how long the first contact with the broker may take before
    the calls waiting for it fail with UNAVAILABLE (`client_sdk.connection`; None: each call's
    own timeout); `limits`: the client's own message size limits. `keys`: CURVE keys for a
    broker started with `--keys` (see `client_keys`); the key's role decides what the broker
    lets this client do (infer, status, plan: any; deploy, undeploy, training: operator keys
    only). `connection`: one made already (the in-process test mesh's), used instead of a
    socket to `address`; the other arguments are then its own."""

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = 60.0,
        connect_timeout: float | None = CONNECT_TIMEOUT_S,
        limits: p.Limits = p.DEFAULT_LIMITS,
        keys: Any = None,
        connection: Connection | None = None,
    ) -> None:
        self.connection = connection or Connection(
            address,
            timeout=timeout,
            connect_timeout=connect_timeout,
            limits=limits,
            curve=client_keys(keys),
        )
        self.codecs = Codecs(self)  # language models' tokenizers, fetched once each

    # What the connection knows, read as the client's own attributes.
    @property
    def address(self) -> str:
        """The broker's address."""
        return self.connection.address

    @property
    def timeout(self) -> float:
        """Seconds a call waits when it gives none."""
        return self.connection.timeout

    @property
    def limits(self) -> p.Limits:
        """The client's own message size limits."""
        return self.connection.limits

    @property
    def curve(self) -> CurveKeys | None:
        """The client's CURVE keys (None: no CURVE)."""
        return self.connection.curve

    @property
    def broker_limits(self) -> p.Limits | None:
        """The broker's limits on the current connection (None: not stated yet, or none)."""
        return self.connection.broker_limits

    @property
    def resent(self) -> int:
        """Calls sent again after the connection was lost with them in flight."""
        return self.connection.resent

    @property
    def bundled_calls(self) -> int:
        """Calls sent in bundles."""
        return self.connection.bundled_calls

    @property
    def bundled_answers(self) -> int:
        """Answers that came in bundles."""
        return self.connection.bundled_answers

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ API

    async def deploy(
        self,
        name: str,
        factory: str | None = None,
        *,
        hf: str | None = None,
        kwargs: Mapping[str, Any] | None = None,
        weights: str | None = None,
        seed: int | None = None,
        dtype: str = "float32",
        stages: int | None = None,
        max_batch_size: int = 8,
        replicas: int | None = None,
        inputs: Mapping[str, Any] | None = None,
        slo_ms: float | None = None,
        max_context: int | None = None,
        max_seqs: int | None = None,
        kv_share: float | None = None,
        timeout: float = 600.0,
    ) -> p.ModelRow:
        """Deploy model `name`; returns its row of the status (`flowmesh.reports.ModelRow`:
        `.stages`, `.bytes`, `.replicas`, ...) once every stage is held by its workers.

        The model: `factory` ('module:callable' from the broker's allow-list) called with
        `kwargs`, or `hf`, a local Hugging Face model directory (one of the two is needed).
        Its weights: a safetensors file (`weights`), or else the factory's initialisation
        under `seed`: a model deployed without weights is initialised from `seed`, 0 when not
        given (an `hf` directory brings its own weights). `dtype`: the parameters' dtype;
        `stages`: how many pipeline stages (default: the broker's choice); `max_batch_size`:
        the most rows batched into one forward; `replicas`: copies of the pipeline (default:
        the broker's choice); `inputs`: the inputs' {name: {"dtype", "shape"}} when the model
        does not declare them; `slo_ms`: the model's latency objective in milliseconds.
        `timeout`: seconds for the whole deployment."""
        spec = {
            "name": name,
            **_model_source("deploy", factory, hf),
            "kwargs": dict(kwargs or {}),
            "weights": weights,
            "seed": seed,
            "dtype": dtype,
            "stages": stages,
            "max_batch_size": max_batch_size,
            "replicas": replicas,
            "inputs": dict(inputs) if inputs else None,
            "slo_ms": slo_ms,
        }
        # Only when given: a broker that predates generation still takes the spec.
        generation = {"max_context": max_context, "max_seqs": max_seqs, "kv_share": kv_share}
        spec.update({k: v for k, v in generation.items() if v is not None})
        reply = await self.connection.call(
            p.Deploy(
                id=self.connection.next_id(),
                spec=spec,
                timeout_ms=self.connection.timeout_ms(timeout),
            ),
            timeout,
        )
        assert isinstance(reply, p.Deployed)
        return reply.model

    async def undeploy(
        self, name: str, timeout: float | None = None, *, drain: float | None = None
    ) -> p.Undeployed:
        """Undeploy model `name`: its stages leave the workers, its calls in queue fail. Its
        running generations may first end, for up to `drain` seconds (None: the broker's
        `--undeploy-drain`, 30 s by default; 0: at once), new calls refused meanwhile; the
        answer counts those that ended (`drained`) and those still running then (`cut`)."""
        if timeout is None and drain is not None:
            timeout = max(self.connection.seconds(None), drain + 10.0)
        reply = await self.connection.call(
            p.Undeploy(id=self.connection.next_id(), model=name, drain_s=drain), timeout
        )
        assert isinstance(reply, p.Undeployed)
        self.codecs.forget(name)  # a model deployed under that name later may be another
        return reply

    async def infer(
        self,
        model: str,
        inputs: torch.Tensor | Mapping[str, torch.Tensor],
        timeout: float | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Run `inputs` (a tensor, or a dict of named tensors; dim 0 is the batch) through
        `model`; returns a tensor, or a dict of tensors if the model returns several."""
        out, _info = await self.infer_with_info(model, inputs, timeout)
        return out

    async def infer_with_info(
        self,
        model: str,
        inputs: torch.Tensor | Mapping[str, torch.Tensor],
        timeout: float | None = None,
    ) -> tuple[torch.Tensor | dict[str, torch.Tensor], dict[str, Any]]:
        """Like `infer`, plus the broker's account: latency, queueing, batch size, workers."""
        tensors = {"": inputs} if is_tensor(inputs) else dict(inputs)
        # Made contiguous once here: the message may be encoded again (sent once more after a
        # lost connection), and a tensor that is not would be copied each time.
        tensors = {k: sendable(t) for k, t in tensors.items()}
        msg = p.Infer(
            id=self.connection.next_id(),
            model=model,
            tensors=tensors,
            timeout_ms=self.connection.timeout_ms(timeout),
        )
        reply = await self.connection.call(msg, timeout)
        assert isinstance(reply, p.Result)
        out = {k: ref.tensor() for k, ref in reply.tensors.items()}
        info = msgspec.structs.asdict(reply.info)  # a plain dict, as callers have always had
        if list(out) == [""]:
            return out[""], info
        return out, info

    async def generate(
        self,
        model: str,
        prompt: str | Sequence[str] | None = None,
        *,
        ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        messages: Sequence[Any] | None = None,
        max_tokens: int | None = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        timeout: float | None = None,
    ) -> Generation | list[Generation]:
        """Generate text with language model `model` (deployed from a Hugging Face directory):
        a `Generation` (`.text`, `.ids`, `.finish_reason`, token counts, `.ttft_ms`,
        `.token_ms`), or a list of them, one per prompt, for a batch of prompts.

        The prompt, one of: `prompt`, text (or a list of texts), encoded with the model's
        tokenizer as the model's own would (its bos and such); `ids`, token ids (or a list of
        lists; a numpy or torch integer array too, 1-D for one prompt, 2-D for a batch);
        `messages`, a chat ([{"role": ..., "content": ...}, ...], or a list of chats)
        written with the model's chat template, ready for the assistant's answer.
        Up to `max_tokens` new tokens each: the most likely token at `temperature` 0, else a
        draw cut to the `top_k` most likely (0: no cut) and then to the smallest set whose
        probability reaches `top_p`, from a generator seeded with `seed` (None: an unseeded
        one). A sequence ends ("stop") at the model's end-of-sequence ids (unless
        `ignore_eos`), at one of `stop_ids`, or at a `stop` string (its text ends before it),
        else ("length") after `max_tokens` (None: once prompt and new tokens fill the model's
        context, as OpenAI's chat does). `timeout`: for the whole call (the client's when
        None)."""
        return await generate_async(self, _gen_ask(locals()))

    def generate_stream(
        self,
        model: str,
        prompt: str | Sequence[str] | None = None,
        *,
        ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        messages: Sequence[Any] | None = None,
        max_tokens: int | None = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        timeout: float | None = None,
    ) -> AsyncGenStream:
        """`generate`, its tokens as they come: an async iterator of chunks (`.index`, the
        prompt's; `.ids`, new tokens; `.text`, their text; `.finish_reason` on a sequence's
        last chunk), its `.generations` the results once it has ended. Use it with
        `async with` (or `aclose()` it): closing it early stops its sequences on the broker,
        which frees their memory at once."""
        return AsyncGenStream(self, _gen_ask(locals()))

    async def status(self, timeout: float | None = None) -> p.BrokerStatus:
        """The broker's view of the mesh, a typed value (`flowmesh.reports.BrokerStatus`) read
        by attribute: `.models`, `.workers`, `.partitioners`, `.jobs` (rows), `.totals`
        (counters); `msgspec.to_builtins` makes it plain data. `timeout`: the client's when
        None."""
        reply = await self.connection.call(p.Status(id=self.connection.next_id()), timeout)
        assert isinstance(reply, p.StatusReply)
        return reply.status

    async def plan(
        self,
        factory: str | None = None,
        *,
        hf: str | None = None,
        kwargs: Mapping[str, Any] | None = None,
        dtype: str = "float32",
        inputs: Mapping[str, Any] | None = None,
        stages: int | None = None,
        kind: str = "stages",
        mem_cap: int | None = None,
        target_bytes: int | None = None,
        optimizer: str = "adam",
        batch: int = 1,
        measure: bool = False,
        timeout: float = 120.0,
    ) -> dict[str, Any]:
        """Ask the partitioner for a plan of model `factory(**kwargs)`, or of the local Hugging
        Face model directory `hf` (one of the two is needed). `kind` "stages": pipeline stages
        for serving, `stages` of them (each within `mem_cap` bytes when given), or without
        `stages` the fewest that each fit `mem_cap`; "chunks": training sub-models of about
        `target_bytes` each, for the `optimizer` and `batch` rows. `measure`: time the blocks
        on the partitioner too."""
        spec = {
            "name": "plan",
            **_model_source("plan", factory, hf),
            "kwargs": dict(kwargs or {}),
            "dtype": dtype,
            "inputs": dict(inputs) if inputs else None,
        }
        msg = p.PlanRequest(
            id=self.connection.next_id(),
            spec=spec,
            kind=kind,
            stages=stages,
            mem_cap=mem_cap,
            target_bytes=target_bytes,
            optimizer=optimizer,
            batch=batch,
            measure=measure,
            timeout_ms=self.connection.timeout_ms(timeout),
        )
        reply = await self.connection.call(msg, timeout)
        assert isinstance(reply, p.PlanReply)
        return reply.plan.to_dict()

    async def train_open(
        self,
        name: str,
        factory: str | None = None,
        *,
        hf: str | None = None,
        kwargs: Mapping[str, Any] | None = None,
        seed: int | None = None,
        weights: str | None = None,
        resume: str | None = None,
        optimizer: Mapping[str, Any] | None = None,
        loss: str = "cross_entropy",
        batch_size: int,
        clip_grad_norm: float | None = None,
        accumulate: int = 1,
        dtype: str | None = None,
        activations: str | None = None,
        rng_seed: int | None = None,
        stop_on_nonfinite: bool = True,
        chunk_bytes: int | None = None,
        pipeline: int | Literal["auto"] = 0,
        timeout: float = 600.0,
        idle_close: float | None = None,
    ) -> AsyncJob:
        """Open training job `name` of model `factory(**kwargs)` on the worker with the most
        free training memory; returns the job once its worker holds it.

        Weights: the factory's initialisation under `seed`, a safetensors file (`weights`), a
        local Hugging Face model directory instead of a factory (`hf`: its config and weights,
        read by the workers under their data roots; no `seed`), or a checkpoint directory
        written by `job.save` (`resume`; the optimizer settings then default to the
        checkpoint's). `optimizer`: {"name": "sgd" | "adam" | "adamw", "lr": ..., ...}
        (torch.optim keyword arguments); `loss`: "cross_entropy" or "mse"; `batch_size`: rows
        per step, split into `accumulate` micro-batches; `clip_grad_norm`: clip by global norm;
        `rng_seed`: the job's own random stream (dropout), `seed` when not given;
        `chunk_bytes`: the sub-models' target footprint (default: half the worker's training
        bytes). `dtype`: what the forward and the loss compute in, "float32" (the default) or
        "bfloat16": mixed precision as torch.autocast gives it, the parameters, gradients and
        optimizer state staying float32 (the master weights) and the backward and the update
        running on them; "float16" is refused (it would need loss scaling). `activations`: what
        each sub-model's backward does for its forward's activations, "recompute" (run the
        forward again), "keep" (the first forward's graph kept until the backward), "selective"
        (the forward's matrix products' outputs kept, the rest computed again in the backward:
        torch's selective activation checkpointing) or "auto" (the default: per sub-model,
        whichever the worker measured cheaper). With `resume` and
        no `optimizer`, the checkpoint's. `pipeline`: the model cut into this many stages on as
        many workers (pipeline-parallel, each stage's weights resident on its worker), its
        `accumulate` micro-batches flowing through them; 0 or 1, one worker by memory flow;
        "auto", the broker's choice: one worker unless the job does not fit the free training
        bytes of the worker it would go to and, cut into stages, fits those of several (then
        over the fewest that hold it; `job.info.pipeline` says which). `idle_close`: the broker
        closes the job once no call of it has been made, nor been in flight, for that many
        seconds (a client that died gives its memory back; a later call of it is told why);
        None, the default: open until closed."""
        if optimizer is None and resume is None:
            raise ValueError("train_open needs optimizer=..., or resume= a checkpoint")
        if isinstance(pipeline, str) and pipeline.strip().lower() == "auto":
            pipeline = "auto"  # as the CLI takes it
        if pipeline != "auto" and not (
            isinstance(pipeline, int) and not isinstance(pipeline, bool) and 0 <= pipeline <= 64
        ):
            raise ValueError(f'train_open: pipeline={pipeline!r}: 0 to 64 stages, or "auto"')
        if optimizer is None and (dtype is not None or activations is not None):
            raise ValueError(
                "train_open(resume=..., dtype=... or activations=...) needs optimizer= too: "
                "without one the job continues with the checkpoint's training configuration"
            )
        spec = {
            "name": name,
            **_model_source("train_open", factory, hf),
            "kwargs": dict(kwargs or {}),
            "weights": weights,
            "seed": seed,
            # The master weights: float32 whatever `dtype` computes in (the configuration's).
            "dtype": "float32",
        }
        config: dict[str, Any] | None = None  # None: the checkpoint's (resume)
        if optimizer is not None:
            config = {
                "optimizer": dict(optimizer),
                "loss": loss,
                "clip_grad_norm": clip_grad_norm,
                "accumulate": accumulate,
                "seed": rng_seed if rng_seed is not None else (seed or 0),
                "stop_on_nonfinite": stop_on_nonfinite,
            }
            if dtype is not None:
                config["compute_dtype"] = dtype
            if activations is not None:
                config["activations"] = activations
        msg = p.TrainOpen(
            id=self.connection.next_id(),
            job=name,
            spec=spec,
            config=config,
            batch=batch_size,
            resume=str(resume) if resume is not None else None,
            chunk_bytes=chunk_bytes,
            timeout_ms=self.connection.timeout_ms(timeout),
            pipeline=pipeline,
            idle_close_s=idle_close,
        )
        reply = await self.connection.call(msg, timeout)
        assert isinstance(reply, p.TrainOpened)
        return AsyncJob(self, name, reply.job)

    async def train_close(self, name: str, timeout: float | None = None) -> None:
        """Close training job `name`, opened by any client (one whose program ended without
        closing it holds its memory, and its name, until then, or until its `idle_close`):
        steps still queued fail, its memory goes to the other jobs. `timeout`: the client's
        when None."""
        msg = p.TrainClose(
            id=self.connection.next_id(), job=name, timeout_ms=self.connection.timeout_ms(timeout)
        )
        await self.connection.call(msg, timeout)

    async def jobs(self, timeout: float | None = None) -> list[p.JobRow]:
        """Every open training job, a `flowmesh.reports.JobRow` each (read by attribute):
        `.worker`, `.state`, `.step`, `.last_loss`, `.steps_per_s`, `.sub_models`, ...
        `timeout`: the client's when None."""
        reply = await self.connection.call(p.Jobs(id=self.connection.next_id()), timeout)
        assert isinstance(reply, p.JobsReply)
        return reply.jobs

    # One declaration of the sweep's parameters: the coroutine in `client_sdk.sweep`, as a method.
    sweep = sweep_async

    async def close(self) -> None:
        """Close the connection; calls still in flight fail with UNAVAILABLE."""
        await self.connection.close()


def _gen_ask(args: dict[str, Any]) -> GenAsk:
    """A generate method's arguments (its `locals()`) as one value."""
    sampling = {
        name: args[name] for name in ("max_tokens", "temperature", "top_p", "top_k", "seed")
    }
    sampling["stop_ids"] = list(args["stop_ids"] or [])
    sampling["ignore_eos"] = args["ignore_eos"]
    return GenAsk(
        model=args["model"],
        prompt=args["prompt"],
        ids=args["ids"],
        messages=args["messages"],
        sampling=sampling,
        stop=args["stop"],
        timeout=args["timeout"],
    )


def _model_source(call: str, factory: str | None, hf: str | None) -> dict[str, Any]:
    """The spec's fields naming the model: "factory" always (None with `hf` alone), and "hf"
    only when given, so that a broker that knows no "hf" still takes a factory's spec."""
    if factory is None and hf is None:
        raise ValueError(f"{call} needs factory='module:callable' or hf= a model directory")
    return {"factory": factory} if hf is None else {"factory": factory, "hf": str(hf)}


class _Blocking:
    """`Client.<name>`, the blocking twin of a coroutine method of `AsyncClient`.

    The class attribute is this descriptor; reading it gives a plain function carrying the
    coroutine's signature (`__signature__`), docstring and annotations, its return annotation
    that of the coroutine's result (or `wrap`'s): what help(), inspect and editors show. A call
    binds its arguments against that signature (a wrong call raises TypeError in the caller),
    starts the coroutine on the client's own loop thread and waits for its result, for at most
    the call's `timeout` (the signature's default when the caller gives none, the client's
    `timeout` when that is None) plus a grace; without a deadline of its own when `deadline`
    is False (a call made of many calls, each under `timeout`). `wrap(client, result)` turns the
    result into its blocking twin (an `AsyncJob` into a `Job`).
    """

    def __init__(
        self,
        afn: Callable[..., Awaitable[Any]],
        wrap: Callable[[Client, Any], Any] | None,
        deadline: bool,
    ) -> None:
        if not inspect.iscoroutinefunction(afn):
            raise TypeError(f"{afn!r} is not a coroutine function")
        self.afn, self.wrap, self.deadline = afn, wrap, deadline
        self.fn: Callable[..., Any] | None = None

    def __set_name__(self, owner: type, name: str) -> None:
        afn, wrap, deadline = self.afn, self.wrap, self.deadline
        sig = inspect.signature(afn)
        returns = sig.return_annotation
        if wrap is not None:
            returns = wrap.__name__ if isinstance(wrap, type) else inspect.Signature.empty
        sig = sig.replace(return_annotation=returns)
        has_timeout = "timeout" in sig.parameters

        def method(self: Client, /, *args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(self, *args, **kwargs)
            bound.apply_defaults()
            timeout = bound.arguments["timeout"] if has_timeout else None
            coro = afn(self._async, *bound.args[1:], **bound.kwargs)
            result = self._run(coro, timeout) if deadline else self._wait(coro)
            return result if wrap is None else wrap(self, result)

        method.__name__ = name
        method.__qualname__ = f"{owner.__qualname__}.{name}"
        method.__module__ = owner.__module__
        method.__doc__ = afn.__doc__
        method.__signature__ = sig  # type: ignore[attr-defined]
        method.__annotations__ = {**afn.__annotations__, "return": returns}
        if returns is inspect.Signature.empty:
            del method.__annotations__["return"]
        self.fn = method

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if self.fn is None:
            raise AttributeError("a _Blocking method must be assigned in a class body")
        return self.fn if obj is None else types.MethodType(self.fn, obj)


@overload
def _blocking(
    afn: Callable[Concatenate[AsyncClient, P], Awaitable[R]], *, deadline: bool = True
) -> Callable[Concatenate[Client, P], R]: ...


@overload
def _blocking(
    afn: Callable[Concatenate[AsyncClient, P], Awaitable[Any]],
    *,
    wrap: Callable[[Client, Any], T],
    deadline: bool = True,
) -> Callable[Concatenate[Client, P], T]: ...


def _blocking(
    afn: Callable[..., Awaitable[Any]],
    *,
    wrap: Callable[[Client, Any], Any] | None = None,
    deadline: bool = True,
) -> Any:
    """The blocking twin of coroutine method `afn` of `AsyncClient` (see `_Blocking`); typed so
    that editors show the coroutine's parameters on the `Client` method too."""
    return _Blocking(afn, wrap, deadline)


class Client:
    """Blocking client: the same calls as `AsyncClient`, run on a private event loop thread.

    Each method is built from the coroutine of the same name (`_blocking`): one declaration of
    the parameters and their documentation serves both clients.
    Safe to share between threads; each call blocks its caller only. The arguments are
    `AsyncClient`'s.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        *,
        timeout: float = 60.0,
        connect_timeout: float | None = CONNECT_TIMEOUT_S,
        limits: p.Limits = p.DEFAULT_LIMITS,
        keys: Any = None,
        connection: Connection | None = None,
    ) -> None:
        curve = client_keys(keys)  # a bad key fails here, before a thread starts
        # The loop every call of this client, and of its training jobs, runs on.
        self.runner = LoopThread()
        self._async = AsyncClient(
            address,
            timeout=timeout,
            connect_timeout=connect_timeout,
            limits=limits,
            keys=curve or False,
            connection=connection,
        )
        self.address = address

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """`coro`'s result, run on the loop thread, waited for at most the call's `timeout`
        (the client's when None) and a grace (`LoopThread.run`)."""
        return self.runner.run(coro, self._async.connection.seconds(timeout))

    def _wait(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`'s result, run on the loop thread, however long it takes."""
        return self.runner.wait(coro)

    deploy = _blocking(AsyncClient.deploy)
    undeploy = _blocking(AsyncClient.undeploy)
    infer = _blocking(AsyncClient.infer)
    infer_with_info = _blocking(AsyncClient.infer_with_info)
    generate = _blocking(AsyncClient.generate)
    # A stream is read chunk by chunk, each under the call's `timeout` (`GenStream`).
    generate_stream = blocking_stream(AsyncClient.generate_stream)
    status = _blocking(AsyncClient.status)
    plan = _blocking(AsyncClient.plan)
    train_open = _blocking(AsyncClient.train_open, wrap=Job)
    train_close = _blocking(AsyncClient.train_close)
    jobs = _blocking(AsyncClient.jobs)
    # A sweep is many calls, each under its `timeout`: no deadline on the whole.
    sweep = _blocking(AsyncClient.sweep, deadline=False)

    def close(self) -> None:
        """Close the connection; calls still in flight fail with UNAVAILABLE."""
        if self.runner.closed:
            return
        with contextlib.suppress(Exception):
            self._run(self._async.close(), 5.0)
        self.runner.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
