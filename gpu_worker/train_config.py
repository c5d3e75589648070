"""The torch side of how a training job trains: the optimizer classes its configuration may
name, and loss specs resolved on the worker.

The configuration itself (`TrainConfig`) and the form of a loss spec are declared, free of
torch, in `flowmesh.train_spec` (they cross processes); `resolve_loss` turns a loss spec into
the callable a job applies, on the worker, where the allow-list is. The factories flowmesh ships
live in `flowmesh.losses`, which holds nothing else:
every callable there is reachable as a factory, so the resolution (which takes the allow-list)
must not be one of them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable

import torch
from torch.nn import functional as F

from flowmesh.errors import Code, FlowmeshError, bad_request
from flowmesh.spec import DEFAULT_ALLOW, factory_allowed
from flowmesh.train_spec import (
    LOSS_NAMES,
    OPTIMIZER_NAMES,
    LossSpec,
    TrainConfig,
    check_loss_spec,
    loss_name,
)

__all__ = [
    "LOSSES",
    "LOSS_ALLOW",
    "OPTIMIZERS",
    "LossSpec",
    "TrainConfig",
    "check_loss_spec",
    "loss_name",
    "optimizer_class",
    "optimizer_states",
    "resolve_loss",
]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
# Options that choose an implementation, not the maths; a probe on the meta device cannot take
# some of them (fused kernels), and drops them.
_IMPL_OPTIONS = ("foreach", "fused", "capturable", "differentiable")


def _cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Language-model logits (batch, time, vocab) against ids (batch, time): classes are last.
    if out.dim() > 2 and target.dim() == out.dim() - 1:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return F.cross_entropy(out, target)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LOSSES: dict[str, LossFn] = {
    "cross_entropy": _cross_entropy,
    "mse": F.mse_loss,
}
# Loss factories shipped with flowmesh: allowed on every worker, whatever its --allow (they are
# flowmesh's own code, like the built-in losses above).
LOSS_ALLOW = ("flowmesh.losses",)
# The names a configuration is checked against, without torch, are these.
assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES and tuple(LOSSES) == LOSS_NAMES


def resolve_loss(loss: LossSpec, allow: Iterable[str] | None = None) -> LossFn:
    """The callable `loss(output, target) -> scalar tensor` of a loss spec, on this worker.

    A factory runs only if its module is on `allow` (the worker's --allow; DEFAULT_ALLOW when not
    given) or is one of flowmesh's own loss modules (LOSS_ALLOW); it is called with its kwargs
    and must return a callable. Refusals are NOT_ALLOWED, other problems BAD_REQUEST; both say
    that the worker refused, at open, before any step runs.
    """
    loss = check_loss_spec(loss)
    if isinstance(loss, str) and loss in LOSSES:
        return LOSSES[loss]
    factory = loss if isinstance(loss, str) else loss["factory"]
    kwargs = {} if isinstance(loss, str) else dict(loss["kwargs"])
    allowed = (*(DEFAULT_ALLOW if allow is None else tuple(allow)), *LOSS_ALLOW)
    if not factory_allowed(factory, allowed):
        raise FlowmeshError(
            Code.NOT_ALLOWED,
            f"the worker refused loss factory {factory!r}: its module is not in the worker's "
            f"allow-list ({', '.join(allowed)}); a loss factory is code the worker runs, so "
            "start workers with --allow for its module",
        )
    module_name, attr = factory.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise bad_request(f"the worker could not import loss factory {factory!r}: {exc}") from None
    make = getattr(module, attr, None)
    if not callable(make):
        raise bad_request(f"loss factory {factory!r} is not a callable on the worker")
    try:
        fn = make(**kwargs)
    except Exception as exc:
        raise bad_request(
            f"loss factory {loss_name(loss)} failed on the worker: {type(exc).__name__}: {exc}"
        ) from None
    if not callable(fn):
        raise bad_request(
            f"loss factory {loss_name(loss)} returned {type(fn).__name__}, not a callable "
            "loss(output, target) -> scalar tensor"
        )
    return fn


def optimizer_class(config: TrainConfig) -> type[torch.optim.Optimizer]:
    return OPTIMIZERS[config.optimizer_name]


def optimizer_states(
    config: TrainConfig, params: list[torch.Tensor]
) -> list[dict[str, torch.dtype]]:
    """The optimizer's per-parameter state tensors (name, dtype), found by one step on meta
    copies: the entries shaped like the parameter are what moves with it."""
    if not params:
        return []
    probes = []
    for p in params:
        q = torch.empty_like(p, device="meta").requires_grad_(True)
        q.grad = torch.empty_like(q)
        probes.append(q)
    kwargs = {k: v for k, v in config.optimizer_kwargs.items() if k not in _IMPL_OPTIONS}
    try:
        opt = optimizer_class(config)(probes, **kwargs)
        opt.step()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise bad_request(f"optimizer {config.optimizer}: {exc}") from None
    out = []
    for q in probes:
        state = opt.state.get(q, {})
        out.append(
            {
                k: v.dtype
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(q.shape) and v.dim()
            }
        )
    return out
