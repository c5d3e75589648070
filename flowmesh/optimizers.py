"""The optimizer a training job names, made into a `torch.optim.Optimizer`.

A job's `optimizer` is a mapping: either `{"name": N, **options}`, N any optimizer of
`torch.optim` by its class name in any case ("adam", "RMSprop", "nadam"), or
`{"factory": "package.module:callable", **options}`, a callable from the worker's allow-list
called as `callable(params, **options)` that returns a `torch.optim.Optimizer` (a class such as
"torch.optim:Adam" is one, and so is a function building a user's own optimizer).

Memory flow keeps each parameter's optimizer state beside the parameter (host tier, device arena)
and moves the two together, so an optimizer trains by memory flow when every tensor of state it
keeps per parameter is shaped like that parameter, or is a scalar (a step count): `state_slots`
finds them by one step on a small probe, at open, and refuses the others with their reason.
`torch.optim` optimizers that cannot run a step of sub-models at all are refused by name
(`UNSUITABLE`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from flowmesh.errors import Code, FlowmeshError, bad_request
from flowmesh.spec import DEFAULT_ALLOW, FACTORY_RE, factory_allowed, import_callable

# Options that choose an implementation, not the maths; a probe cannot take some of them
# (fused kernels want a device), and drops them.
IMPL_OPTIONS = ("foreach", "fused", "capturable", "differentiable")

UNSUITABLE = {
    "lbfgs": "its step needs a closure that re-evaluates the whole model, which a step taken "
    "sub-model by sub-model does not have",
    "sparseadam": "it takes sparse gradients only, and layers give dense ones",
    "adafactor": "it keeps factored row and column statistics, not state shaped like each "
    "parameter, which memory flow moves with the parameter",
}


def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    out = {}
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if (
            inspect.isclass(cls)
            and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer
        ):
            out[name.lower()] = cls
    return out


TORCH_OPTIMIZERS = _torch_optimizers()
# What a job may name: this torch's optimizers, less those memory flow cannot step.
OPTIMIZER_NAMES = tuple(sorted(n for n in TORCH_OPTIMIZERS if n not in UNSUITABLE))


def describe(optimizer: Mapping[str, Any]) -> str:
    """How an optimizer reads in messages: its name or factory."""
    return str(optimizer.get("factory") or optimizer.get("name") or optimizer.get("type"))


def options_of(optimizer: Mapping[str, Any]) -> dict[str, Any]:
    """The options an optimizer is built with: the mapping less what names it."""
    return {k: v for k, v in optimizer.items() if k not in ("name", "type", "factory")}


def optimizer_maker(optimizer: Mapping[str, Any], allow: Iterable[str] | None = None) -> Any:
    """The callable `maker(params, **options) -> torch.optim.Optimizer` an optimizer config
    names. A factory runs only if its module is on `allow` (the worker's --allow;
    DEFAULT_ALLOW when not given): NOT_ALLOWED otherwise; anything else wrong is BAD_REQUEST."""
    factory = optimizer.get("factory")
    if factory is None:
        name = optimizer.get("name", optimizer.get("type"))
        if not isinstance(name, str):
            raise bad_request(f"optimizer {dict(optimizer)!r}: give a 'name' or a 'factory'")
        key = name.lower()
        if key in UNSUITABLE:
            raise bad_request(f"optimizer {name!r} cannot train by memory flow: {UNSUITABLE[key]}")
        if key not in TORCH_OPTIMIZERS:
            raise bad_request(
                f"optimizer {name!r}: torch.optim has no such optimizer; expected one of "
                f"{', '.join(OPTIMIZER_NAMES)}, or a 'factory' from the worker's allow-list"
            )
        return TORCH_OPTIMIZERS[key]
    if not isinstance(factory, str) or not FACTORY_RE.match(factory):
        raise bad_request(f"optimizer factory {factory!r}: expected 'package.module:callable'")
    allowed = tuple(DEFAULT_ALLOW if allow is None else allow)
    module_name = factory.split(":", 1)[0]
    # torch.optim's own classes are torch's code, not a user's: always allowed.
    if module_name != "torch.optim" and not factory_allowed(factory, allowed):
        raise FlowmeshError(
            Code.NOT_ALLOWED,
            f"the worker refused optimizer factory {factory!r}: its module is not in the "
            f"worker's allow-list ({', '.join(allowed) or 'empty'}); an optimizer factory is code "
            "the worker runs, so start workers with --allow for its module",
        )
    return import_callable(factory, "optimizer factory")


def make_optimizer(
    optimizer: Mapping[str, Any],
    params: list[torch.Tensor],
    allow: Iterable[str] | None = None,
    *,
    maker: Any = None,
) -> torch.optim.Optimizer:
    """The optimizer `optimizer` names over `params`, with its options (`maker`: the one
    `optimizer_maker` gave, not looked up again)."""
    maker = optimizer_maker(optimizer, allow) if maker is None else maker
    return _built(maker, optimizer, options_of(optimizer), params)


def _built(
    maker: Any, optimizer: Mapping[str, Any], options: dict[str, Any], params: list[torch.Tensor]
) -> torch.optim.Optimizer:
    try:
        opt = maker(params, **options)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise bad_request(f"optimizer {describe(optimizer)}: {exc}") from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise bad_request(
            f"optimizer factory {describe(optimizer)} returned {type(opt).__name__}, not a "
            "torch.optim.Optimizer"
        )
    return opt


def state_slots(
    optimizer: Mapping[str, Any],
    params: list[torch.Tensor],
    allow: Iterable[str] | None = None,
) -> list[dict[str, torch.dtype]]:
    """Per parameter, the state tensors the optimizer keeps shaped like it (name -> dtype): what
    moves with the parameter. Found by one step on small CPU probes of the parameters' ranks and
    dtypes (sides 2, 3, 5, ... so that a parameter-shaped state is told from a factored one);
    an optimizer keeping any other state per parameter is refused (BAD_REQUEST, naming it)."""
    if not params:
        return []
    maker = optimizer_maker(optimizer, allow)
    sides = (2, 3, 5, 7, 11, 13, 17, 19)
    probes = []
    for p in params:
        if p.dim() > len(sides):
            raise bad_request(f"a parameter of {p.dim()} dimensions is more than a probe takes")
        q = torch.zeros(sides[: p.dim()], dtype=p.dtype).requires_grad_(True)
        q.grad = torch.full_like(q, 0.5)
        probes.append(q)
    options = {k: v for k, v in options_of(optimizer).items() if k not in IMPL_OPTIONS}
    try:
        opt = _built(maker, optimizer, options, probes)
    except FlowmeshError:
        # Refused on the probes: made once over the model's own parameters (nothing is
        # stepped), so that a refusal names one of their shapes, not a probe's (2, 3, 5, ...).
        _built(maker, optimizer, options, params)
        raise
    try:
        opt.step()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise bad_request(f"optimizer {describe(optimizer)}: {exc}") from None
    out = []
    for q in probes:
        slots = {}
        for key, v in opt.state.get(q, {}).items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue  # scalars (a step count) stay with the optimizer, wherever it runs
            if tuple(v.shape) != tuple(q.shape):
                raise bad_request(
                    f"optimizer {describe(optimizer)} keeps state {key!r} of shape "
                    f"{tuple(v.shape)} for a parameter of shape {tuple(q.shape)}; memory flow "
                    "moves each parameter's state with it, so it takes only optimizers whose "
                    "state is shaped like their parameters"
                )
            slots[key] = v.dtype
        out.append(slots)
    return out


# Parameter bytes whose first optimizer state one `step_adopting` part may make at once (Adam's
# two states: twice as many bytes of state).
FIRST_STATE_PART_BYTES = 64 << 20


def step_adopting(
    opt: torch.optim.Optimizer, adopt: Callable[[], Any], part_bytes: int | None = None
) -> None:
    """`opt.step()`, then `adopt()`, which moves the state the optimizer made where it lives
    (a pipelined stage's arena range, a sub-model's host tier). An optimizer makes its
    parameters' state at their first update, beside what bounds a device's memory (the arena);
    made for every parameter at once, that is the size of the whole state, on top of the rest.
    So where more than `part_bytes` (`FIRST_STATE_PART_BYTES`) of parameters step for the first
    time, they step in parts of at most that (at least one parameter each), those with state
    already in the first, each part's state adopted before the next makes its own. The maths is
    the same: a step of `torch.optim` updates each parameter from its own gradient and state
    alone (memory flow already steps each sub-model's parameters apart)."""
    limit = FIRST_STATE_PART_BYTES if part_bytes is None else part_bytes
    params = [p for group in opt.param_groups for p in group["params"]]
    parts: list[list[torch.Tensor]] = [[]]
    fresh = 0
    for p in params:
        if p.grad is None:
            continue
        if not opt.state.get(p):
            nbytes = p.numel() * p.element_size()
            if fresh and fresh + nbytes > limit:
                parts.append([])
                fresh = 0
            fresh += nbytes
        parts[-1].append(p)
    if len(parts) == 1:
        opt.step()
        adopt()
        return
    grads = [p.grad for p in params]
    try:
        for part in parts:
            members = {id(p) for p in part}
            for p, g in zip(params, grads, strict=True):
                p.grad = g if id(p) in members else None
            opt.step()
            adopt()
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def state_count(optimizer: str | Mapping[str, Any], allow: Iterable[str] | None = None) -> int:
    """How many tensors of its parameter's size the optimizer keeps per parameter (sgd 0, sgd
    with momentum 1, adam 2, adam with amsgrad 3, ...): what a training plan counts."""
    if isinstance(optimizer, str):
        optimizer = {"name": optimizer}
    probe = torch.zeros(2, 3)
    return len(state_slots(optimizer, [probe], allow)[0])
