"""Plain-PyTorch training: what a user writes in one process, the reference the mesh is held to.

The mesh's training (one job split into sub-models over workers, micro-batches, checkpoints)
must give the losses and weights of this loop on the same model, seed, optimizer and batches:
the tests compare against it, and the demo prints it beside the mesh's losses. It is written
once here so that every comparison is with the same loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from flowmesh.modelio.inputs import call_model
from flowmesh.optimizers import make_optimizer, optimizer_maker

Loss = Callable[[Any, torch.Tensor], torch.Tensor]


def cross_entropy(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension of the logits (a model output's `.logits` if it
    has them): one class per row, or one per position of a sequence."""
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def optimizer(model: nn.Module, config: Mapping[str, Any]) -> torch.optim.Optimizer:
    """The optimizer `config` names (`flowmesh.optimizers`: a torch.optim name or a factory),
    with the rest of `config` as its options; a factory runs without an allow-list check, as in
    the user's own process."""
    maker = optimizer_maker(config, allow=[str(config.get("factory", "")).split(":")[0]])
    return make_optimizer(config, list(model.parameters()), maker=maker)


def train(
    model: nn.Module,
    config: Mapping[str, Any],
    batches: Iterable[tuple[Any, torch.Tensor]],
    *,
    loss: Loss = cross_entropy,
    clip: float | None = None,
    accumulate: int = 1,
    rng_seed: int | None = None,
) -> list[float]:
    """Train `model` in place, one optimizer step per batch, and return each step's loss.

    A batch's inputs are one tensor or a dict of keyword inputs (`call_model`). Each step:
    zero_grad; the batch as `accumulate` micro-batches, each contributing loss / N
    to the gradient (the step's loss is their sum); clip by global norm if `clip`; step.
    The caller's random state is left as it was; with `rng_seed`, the steps draw (dropout)
    from torch's generator seeded so.
    """
    opt = optimizer(model, config)
    model.train()
    losses = []
    with torch.random.fork_rng(devices=[]):
        if rng_seed is not None:
            torch.manual_seed(rng_seed)
        for x, y in batches:
            opt.zero_grad()
            total = 0.0
            for xm, ym in _micro_batches(x, y, accumulate):
                value = loss(call_model(model, xm), ym)
                if accumulate > 1:
                    value = value / accumulate
                value.backward()
                total += value.item()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            losses.append(total)
    return losses


def _micro_batches(x: Any, y: torch.Tensor, n: int) -> Iterable[tuple[Any, torch.Tensor]]:
    # One micro-batch is the batch itself, whatever its inputs are (a tensor or a dict of them).
    if n == 1:
        return [(x, y)]
    if isinstance(x, torch.Tensor):
        return zip(x.chunk(n), y.chunk(n), strict=True)
    parts = zip(*(v.chunk(n) for v in x.values()), strict=True)  # one batch size: as many chunks
    xs = [dict(zip(x, part, strict=True)) for part in parts]
    return zip(xs, y.chunk(n), strict=True)
