"""How a training job trains, declared once and free of torch: `TrainConfig` (a `msgspec.Struct`
that `TrainOpen` carries, checked on receipt by msgspec and by its `__post_init__`) and the form
of a loss spec.

A loss spec is plain data that crosses processes: a built-in name (`LOSS_NAMES`), a loss factory
"package.module:callable", or {"factory": ..., "kwargs": {...}}. `check_loss_spec` checks its
form anywhere; the worker resolves it against its allow-list (`gpu_worker.train_config`), and
the optimizer a configuration names with `flowmesh.optimizers`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from flowmesh.errors import FlowmeshError, Invalid, bad_request
from flowmesh.spec import FACTORY_RE, MAX_KWARGS_BYTES

# An optimizer's name: a class of torch.optim in any case, resolved where torch is
# (`flowmesh.optimizers`); here only its form is checked.
OPTIMIZER_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
LOSS_NAMES = ("cross_entropy", "mse")
ACTIVATION_POLICIES = ("auto", "recompute", "keep", "selective")
# What a job's forward and loss may compute in: float32, or bfloat16 under autocast with the
# parameters, gradients and optimizer state kept float32 (mixed precision, as AMP does).
COMPUTE_DTYPES = ("float32", "bfloat16")
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
        if loss in LOSS_NAMES or FACTORY_RE.match(loss):
            return loss
        raise bad_request(
            f"loss {loss!r}: expected one of {', '.join(LOSS_NAMES)}, or a loss factory "
            "'package.module:callable' from the worker's allow-list"
        )
    if isinstance(loss, Mapping):
        unknown = sorted(set(loss) - {"factory", "kwargs"})
        factory, kwargs = loss.get("factory"), loss.get("kwargs") or {}
        if unknown or not isinstance(factory, str) or not FACTORY_RE.match(factory):
            raise bad_request(
                f"loss {dict(loss)!r}: a mapping needs 'factory': 'package.module:callable' "
                "and optionally 'kwargs' (nothing else)"
            )
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise bad_request(f"loss {factory}: kwargs must be a mapping with string keys")
        try:
            size = len(json.dumps(dict(kwargs)))
        except (TypeError, ValueError) as exc:
            raise bad_request(f"loss {factory}: kwargs must be plain data: {exc}") from None
        if size > MAX_KWARGS_BYTES:
            raise bad_request(f"loss {factory}: kwargs are {size} bytes, limit {MAX_KWARGS_BYTES}")
        return {"factory": factory, "kwargs": dict(kwargs)}
    raise bad_request(
        f"loss must be a name, a factory string or a mapping, got {type(loss).__name__}"
    )


class TrainConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a job trains: optimizer, loss and step options (plain data, JSON-able)."""

    optimizer: dict[str, Any]
    # A built-in name, "package.module:callable" or {"factory": ..., "kwargs": {...}}: a factory
    # from the worker's allow-list returning loss(output, target) -> scalar (resolve_loss).
    loss: str | dict[str, Any] = "cross_entropy"
    # int or float, as given (a checkpoint keeps the configuration as it came).
    clip_grad_norm: int | float | None = None
    accumulate: int = 1  # micro-batches per step: the step's batch is split into this many
    seed: int = 0  # the job's RNG stream (dropout); weights come from the model's own seed
    stop_on_nonfinite: bool = True  # a nan/inf loss fails the step (no update) instead of applying
    # The forward's and the loss's dtype (COMPUTE_DTYPES); a checkpoint from before it has none.
    compute_dtype: str = "float32"
    # What a sub-model's backward does for its forward's activations (ACTIVATION_POLICIES):
    # "auto" chooses per sub-model by measured cost (`gpu_worker.activation_keep`); "recompute",
    # "keep" and "selective" force one.
    activations: str = "auto"

    def __post_init__(self) -> None:
        try:
            self._check()
        except FlowmeshError as exc:  # msgspec reports a ValueError with the field's path
            raise Invalid(exc.code, exc.reason) from None

    def _check(self) -> None:
        if not isinstance(self.optimizer, Mapping):
            raise bad_request(f"optimizer must be a mapping with a name, got {self.optimizer!r}")
        factory = self.optimizer.get("factory")
        name = self.optimizer.get("name", self.optimizer.get("type"))
        if factory is not None:
            if name is not None or not isinstance(factory, str) or not FACTORY_RE.match(factory):
                raise bad_request(
                    f"optimizer factory {factory!r}: expected 'package.module:callable' "
                    "(and no 'name' beside it)"
                )
        elif not isinstance(name, str) or not OPTIMIZER_NAME_RE.match(name):
            raise bad_request(
                f"optimizer {name!r}: give 'name', a torch.optim optimizer (adam, sgd, rmsprop, "
                "...), or 'factory', 'package.module:callable' from the worker's allow-list"
            )
        msgspec.structs.force_setattr(self, "optimizer", dict(self.optimizer))
        msgspec.structs.force_setattr(self, "loss", check_loss_spec(self.loss))
        clip = self.clip_grad_norm
        if clip is not None and (
            isinstance(clip, bool)
            or not isinstance(clip, int | float)
            or not math.isfinite(clip)
            or clip <= 0
        ):
            raise bad_request(f"clip_grad_norm must be a positive number or null, got {clip!r}")
        n = self.accumulate
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise bad_request(f"accumulate must be a positive integer, got {n!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise bad_request(f"seed must be an integer, got {self.seed!r}")
        if self.compute_dtype == "float16":
            raise bad_request(
                "compute_dtype 'float16' would need loss scaling (its small gradients underflow), "
                "which flowmesh does not do: use 'bfloat16' for mixed precision"
            )
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise bad_request(
                f"compute_dtype {self.compute_dtype!r}: expected 'float32', or 'bfloat16' for "
                "mixed precision (float32 parameters, the forward and the loss in bfloat16)"
            )
        if self.activations not in ACTIVATION_POLICIES:
            raise bad_request(
                f"activations {self.activations!r}: expected one of "
                f"{', '.join(ACTIVATION_POLICIES)}"
            )

    @property
    def optimizer_name(self) -> str:
        """The optimizer's name, lower case, or its factory."""
        factory = self.optimizer.get("factory")
        if isinstance(factory, str):
            return factory
        name = self.optimizer.get("name", self.optimizer.get("type"))
        assert isinstance(name, str)
        return name.lower()

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.optimizer.items() if k not in ("name", "type", "factory")}

    def to_dict(self) -> dict[str, Any]:
        return {
            "optimizer": dict(self.optimizer),
            "loss": self.loss if isinstance(self.loss, str) else dict(self.loss),
            "clip_grad_norm": self.clip_grad_norm,
            "accumulate": self.accumulate,
            "seed": self.seed,
            "stop_on_nonfinite": self.stop_on_nonfinite,
            "compute_dtype": self.compute_dtype,
            "activations": self.activations,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """A configuration kept as plain data (a checkpoint's, a stored job's)."""
        known = set(cls.__struct_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise bad_request(f"unknown training option(s): {', '.join(unknown)}")
        if "optimizer" not in data:
            raise bad_request("a training configuration needs an optimizer")
        return cls(**data)
