"""How a training job trains: its configuration (`TrainConfig`), the optimizers it may name, and
loss specs with their resolution on the worker.

A loss spec is plain data that crosses processes: a built-in name (`LOSSES`), a loss factory
"package.module:callable", or {"factory": ..., "kwargs": {...}}. `check_loss_spec` checks its
form anywhere; `resolve_loss` turns it into the callable a job applies, on the worker, where the
allow-list is. The factories flowmesh ships live in `flowmesh.losses`, which holds nothing else:
every callable there is reachable as a factory, so the resolution (which takes the allow-list)
must not be one of them.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import DEFAULT_ALLOW, FACTORY_RE, MAX_KWARGS_BYTES, factory_allowed

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
LossSpec = str | Mapping[str, Any]


def loss_name(loss: LossSpec) -> str:
    """How a loss spec reads in messages: its name or factory, with its kwargs."""
    if isinstance(loss, str):
        return loss
    kwargs = loss.get("kwargs") or {}
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"{loss.get('factory')}({args})"


def check_loss_spec(loss: Any) -> LossSpec:
    """A loss spec's form (no import): a built-in name, 'package.module:callable', or
    {"factory": "package.module:callable", "kwargs": {...}}; returns it as plain data."""
    if isinstance(loss, str):
        if loss in LOSSES or FACTORY_RE.match(loss):
            return loss
        raise _bad(
            f"loss {loss!r}: expected one of {', '.join(LOSSES)}, or a loss factory "
            "'package.module:callable' from the worker's allow-list"
        )
    if isinstance(loss, Mapping):
        unknown = sorted(set(loss) - {"factory", "kwargs"})
        factory, kwargs = loss.get("factory"), loss.get("kwargs") or {}
        if unknown or not isinstance(factory, str) or not FACTORY_RE.match(factory):
            raise _bad(
                f"loss {dict(loss)!r}: a mapping needs 'factory': 'package.module:callable' "
                "and optionally 'kwargs' (nothing else)"
            )
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise _bad(f"loss {factory}: kwargs must be a mapping with string keys")
        try:
            size = len(json.dumps(dict(kwargs)))
        except (TypeError, ValueError) as exc:
            raise _bad(f"loss {factory}: kwargs must be plain data: {exc}") from None
        if size > MAX_KWARGS_BYTES:
            raise _bad(f"loss {factory}: kwargs are {size} bytes, limit {MAX_KWARGS_BYTES}")
        return {"factory": factory, "kwargs": dict(kwargs)}
    raise _bad(f"loss must be a name, a factory string or a mapping, got {type(loss).__name__}")


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
        raise _bad(f"the worker could not import loss factory {factory!r}: {exc}") from None
    make = getattr(module, attr, None)
    if not callable(make):
        raise _bad(f"loss factory {factory!r} is not a callable on the worker")
    try:
        fn = make(**kwargs)
    except Exception as exc:
        raise _bad(
            f"loss factory {loss_name(loss)} failed on the worker: {type(exc).__name__}: {exc}"
        ) from None
    if not callable(fn):
        raise _bad(
            f"loss factory {loss_name(loss)} returned {type(fn).__name__}, not a callable "
            "loss(output, target) -> scalar tensor"
        )
    return fn


def _bad(reason: str) -> FlowmeshError:
    return FlowmeshError(Code.BAD_REQUEST, reason)


@dataclass(frozen=True)
class TrainConfig:
    """How a job trains: optimizer, loss and step options (plain data, JSON-able)."""

    optimizer: Mapping[str, Any]
    # A built-in name, "package.module:callable" or {"factory": ..., "kwargs": {...}}: a factory
    # from the worker's allow-list returning loss(output, target) -> scalar (resolve_loss).
    loss: LossSpec = "cross_entropy"
    clip_grad_norm: float | None = None
    accumulate: int = 1  # micro-batches per step: the step's batch is split into this many
    seed: int = 0  # the job's RNG stream (dropout); weights come from the model's own seed
    stop_on_nonfinite: bool = True  # a nan/inf loss fails the step (no update) instead of applying

    def __post_init__(self) -> None:
        if not isinstance(self.optimizer, Mapping):
            raise _bad(f"optimizer must be a mapping with a name, got {self.optimizer!r}")
        name = self.optimizer.get("name", self.optimizer.get("type"))
        if not isinstance(name, str) or name.lower() not in OPTIMIZERS:
            raise _bad(f"optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")
        object.__setattr__(self, "optimizer", dict(self.optimizer))
        object.__setattr__(self, "loss", check_loss_spec(self.loss))
        clip = self.clip_grad_norm
        if clip is not None and (
            isinstance(clip, bool)
            or not isinstance(clip, int | float)
            or not math.isfinite(clip)
            or clip <= 0
        ):
            raise _bad(f"clip_grad_norm must be a positive number or null, got {clip!r}")
        n = self.accumulate
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise _bad(f"accumulate must be a positive integer, got {n!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise _bad(f"seed must be an integer, got {self.seed!r}")

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        name = self.optimizer.get("name", self.optimizer.get("type"))
        assert isinstance(name, str)
        return OPTIMIZERS[name.lower()]

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.optimizer.items() if k not in ("name", "type")}

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer": dict(self.optimizer),
            "loss": self.loss if isinstance(self.loss, str) else dict(self.loss),
            "clip_grad_norm": self.clip_grad_norm,
            "accumulate": self.accumulate,
            "seed": self.seed,
            "stop_on_nonfinite": self.stop_on_nonfinite,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        known = {"optimizer", "loss", "clip_grad_norm", "accumulate", "seed", "stop_on_nonfinite"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise _bad(f"unknown training option(s): {', '.join(unknown)}")
        return cls(**data)


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
        opt = config.optimizer_class(probes, **kwargs)
        opt.step()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise _bad(f"optimizer {config.optimizer}: {exc}") from None
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
