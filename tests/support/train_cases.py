"""The training models, data and plain-PyTorch loop that the in-process training tests share
(tests/worker/test_training.py, test_pipe_stage.py, test_pipe_runner.py): the exactness table's
cases, seeded models with dropout, BatchNorm, a buffer-dependent forward, an unused parameter and
one that raises, and the reference loop they are held to."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from flowmesh.modelio.build import build_seeded
from flowmesh.modelio.chain import Block, chain_of
from flowmesh.modelio.inputs import declared_inputs, make_inputs
from flowmesh.reference import train
from flowmesh.spec import ModelSpec
from gpu_worker.pipe_stage import PipeStage
from gpu_worker.train_config import TrainConfig
from tests.support.train_grid import MODELS as GRID_MODELS

KIB, MIB = 1 << 10, 1 << 20
RTOL, ATOL = 1e-5, 1e-6
STEPS = 20
Data = list[tuple[Any, torch.Tensor]]


def close(actual: Any, expected: Any, msg: str = "") -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=msg or None)


# -- models ------------------------------------------------------------------------------------


def seeded(make: Callable[[], nn.Module], seed: int) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def dropout_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.3),
        nn.Linear(32, 5),
    )  # fmt: skip


class RunningScale(nn.Module):
    """Divides by a running statistic it updates first (as spectral norm's power iteration
    does): the output depends on the buffer, so a recompute must start from the buffer the
    forward saw, not from the one the forward left."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.5).add_(0.5 * x.abs().mean())
        return x / self.scale


def mixed_net() -> nn.Module:
    """Dropout, BatchNorm and a buffer-dependent forward: the RNG and the buffers must be
    replayed by the recompute and survive a checkpoint."""
    return nn.Sequential(
        nn.Linear(8, 24), nn.BatchNorm1d(24), RunningScale(), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(24, 24), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(24, 5),
    )  # fmt: skip


class Unused(nn.Module):
    """A block with a parameter that never gets a gradient: the optimizer must skip it (AdamW's
    weight decay would otherwise shrink it)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(32, 32)
        self.spare = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def unused_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), Unused(), nn.GELU(), nn.Linear(32, 5))


class Boom(nn.Module):
    """Raises on a sentinel input value; with `in_backward`, only in the recompute."""

    def __init__(self, in_backward: bool = False) -> None:
        super().__init__()
        self.in_backward = in_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == 12345.0).any()) and (torch.is_grad_enabled() or not self.in_backward):
            raise RuntimeError("boom: the model's own code failed")
        return x


def boom_net(in_backward: bool = False) -> nn.Module:
    return nn.Sequential(
        Boom(in_backward), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
        nn.Linear(32, 5),
    )  # fmt: skip


SPECS = {
    "mlp": GRID_MODELS["mlp"],  # the exactness grid's (tests/support/train_grid.py)
    "resnet": ModelSpec(
        name="resnet",
        factory="flowmesh.examples:small_resnet",
        kwargs={"num_classes": 5, "width": 4, "blocks": [1, 1], "image": 8},
        seed=4,
    ),
    "gpt2": ModelSpec(
        name="gpt2",
        factory="flowmesh.examples:hf_gpt2",
        kwargs={"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": 40, "n_positions": 16},
        seed=5,
    ),
}
LOCAL: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "dropout": (dropout_net, 11),
    "mixed": (mixed_net, 12),
    "unused": (unused_net, 13),
}


def build(kind: str) -> nn.Module:
    if kind in SPECS:
        if kind == "gpt2":
            pytest.importorskip("transformers")
        return build_seeded(SPECS[kind])
    make, seed = LOCAL[kind]
    return seeded(make, seed)


def blocks_of(kind: str, model: nn.Module) -> list[Block]:
    if kind in SPECS:
        inputs = declared_inputs(SPECS[kind], model)
        if inputs is not None:
            return chain_of(model, make_inputs(inputs, 1, 1, "cpu"))
    return chain_of(model)


def even_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return list(pairwise(bounds))


def data_for(kind: str, steps: int = STEPS, batch: int = 8, seed: int = 0) -> Data:
    g = torch.Generator().manual_seed(seed)
    out: Data = []
    for _ in range(steps):
        if kind == "gpt2":
            ids = torch.randint(0, 40, (batch, 6), generator=g)
            out.append((ids, torch.randint(0, 40, (batch, 6), generator=g)))
        elif kind == "resnet":
            x = torch.randn(batch, 3, 8, 8, generator=g)
            out.append((x, torch.randint(0, 5, (batch,), generator=g)))
        else:
            x = torch.randn(batch, 8, generator=g)
            out.append((x, torch.randint(0, 5, (batch,), generator=g)))
    return out


def plain_step_loop(model: nn.Module, cfg: TrainConfig, data: Data) -> list[float]:
    """What a PyTorch user writes: zero_grad, N micro-batches of loss/N, clip, step
    (`flowmesh.reference.train`)."""
    return train(
        model,
        cfg.optimizer,
        data,
        clip=cfg.clip_grad_norm,
        accumulate=cfg.accumulate,
        rng_seed=cfg.seed,
    )


CASES = [
    # model, optimizer, sub-models, clip, accumulate
    ("mlp", {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}, 1, None, 1),
    ("mlp", {"name": "adam", "lr": 0.01}, 2, None, 1),
    ("mlp", {"name": "adamw", "lr": 0.01, "weight_decay": 0.05}, 4, 0.3, 1),
    ("mlp", {"name": "adam", "lr": 0.01}, 3, None, 2),
    ("dropout", {"name": "adamw", "lr": 0.01}, 3, None, 1),
    ("dropout", {"name": "sgd", "lr": 0.05, "momentum": 0.9}, 2, 0.3, 2),
    ("resnet", {"name": "sgd", "lr": 0.05, "momentum": 0.9}, 3, None, 1),
    ("mixed", {"name": "adam", "lr": 0.01}, 3, None, 2),
    ("resnet", {"name": "adam", "lr": 0.01}, 2, 0.5, 2),
    ("gpt2", {"name": "adamw", "lr": 0.01}, 2, None, 1),
    ("gpt2", {"name": "adam", "lr": 0.01}, 4, 0.3, 1),
    ("gpt2", {"name": "sgd", "lr": 0.1, "momentum": 0.9}, 3, None, 2),
    ("unused", {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}, 2, None, 1),
]


def pipe_stages(
    kind: str, cfg: TrainConfig, n: int, make: Callable[[], nn.Module] | None = None
) -> list[PipeStage]:
    """Model `kind` (or `make()`'s) cut into `n` even pipeline stages, each built from its own
    copy of the seeded model, as its worker builds it (a tied weight: a copy per stage)."""
    out = []
    for s in range(n):
        blocks = blocks_of(kind, make() if make is not None else build(kind))
        out.append(PipeStage("job", blocks, even_ranges(len(blocks), n), s, cfg))
    return out


class StateBeside:
    """Per step of the optimizers `watched()` names (with the tensors in whose storage their
    state may live: an arena, a host tier's slabs), the bytes of their state outside those:
    what a first update made and has not moved in yet. Other optimizers' steps (the probes a
    job's open steps) are not counted."""

    Watched = tuple[list[torch.optim.Optimizer], list[torch.Tensor]]

    def __init__(self, watched: Callable[[], Watched]) -> None:
        self.watched = watched
        self.per_step: list[int] = []

    def __enter__(self) -> StateBeside:
        self._hook = register_optimizer_step_post_hook(self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()

    def _seen(self, opt: torch.optim.Optimizer, *_: object) -> None:
        optimizers, homes = self.watched()
        if not any(opt is o for o in optimizers):
            return
        ranges = [(h.data_ptr(), h.data_ptr() + h.numel() * h.element_size()) for h in homes]
        beside = 0
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim():
                    at = value.data_ptr()
                    if not any(lo <= at < hi for lo, hi in ranges):
                        beside += value.numel() * value.element_size()
        self.per_step.append(beside)
