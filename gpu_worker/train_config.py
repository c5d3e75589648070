"""The torch side of how a training job trains: its optimizer (`flowmesh.optimizers`, any
torch.optim optimizer by name or an allowed factory) and loss specs resolved on the worker.

The configuration itself (`TrainConfig`) and the form of a loss spec are declared, free of
torch, in `flowmesh.train_spec` (they cross processes); `resolve_loss` turns a loss spec into
the callable a job applies, on the worker, where the allow-list is. The factories flowmesh ships
live in `flowmesh.losses`, which holds nothing else:
every callable there is reachable as a factory, so the resolution (which takes the allow-list)
must not be one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.nn import functional as F

from flowmesh.errors import Code, FlowmeshError, bad_request
from flowmesh.optimizers import make_optimizer, state_slots
from flowmesh.spec import DEFAULT_ALLOW, factory_allowed, import_callable
from flowmesh.train_spec import (
    LOSS_NAMES,
    LossSpec,
    TrainConfig,
    check_loss_spec,
    loss_name,
)

__all__ = [
    "LOSSES",
    "LOSS_ALLOW",
    "LossSpec",
    "TrainConfig",
    "check_loss_spec",
    "checked_loss",
    "loss_name",
    "make_optimizer",
    "optimizer_states",
    "resolve_loss",
]


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
assert tuple(LOSSES) == LOSS_NAMES


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
    make = import_callable(factory, "loss factory")
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


def checked_loss(
    loss_fn: LossFn,
    spec: LossSpec,
    job: str,
    out: torch.Tensor,
    target: torch.Tensor,
    said: str | None = None,
) -> torch.Tensor:
    """`loss_fn(out, target)` of job `job`, checked to be a floating scalar tensor (shape ()).
    A loss that raises is the request's fault (BAD_REQUEST: its outputs' and targets' shapes);
    one that returns anything else, the model code's (MODEL_ERROR). `said`: how the error names
    the loss ("loss NAME" unless given)."""
    name = repr(spec) if isinstance(spec, str) else loss_name(spec)
    try:
        loss = loss_fn(out, target)
    except Exception as exc:
        raise bad_request(
            f"job {job!r}: {said or f'loss {name}'} failed on outputs of shape "
            f"{tuple(out.shape)} and targets of shape {tuple(target.shape)}: {exc}"
        ) from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        what = (
            f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise FlowmeshError(
            Code.MODEL_ERROR,
            f"job {job!r}: loss {name} returned {what}; a loss must return a floating scalar "
            "tensor",
        )
    return loss.reshape(())


def optimizer_states(
    config: TrainConfig, params: list[torch.Tensor], allow: Iterable[str] | None = None
) -> list[dict[str, torch.dtype]]:
    """The optimizer's per-parameter state tensors (name, dtype): what moves with each
    parameter (`flowmesh.optimizers.state_slots`)."""
    return state_slots(config.optimizer, params, allow)
