"""Small models the partitioner must handle (or refuse clearly), as spec factories.

Specs name them as "tests.support.toy_models:<factory>" with `allow=TOY_ALLOW`.
"""

from __future__ import annotations

import torch
from torch import nn

TOY_ALLOW = ("tests.support.toy_models",)


class DataDependent(nn.Module):
    """Whether `b` runs depends on the values: no static chain exists."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.sum() > 0:
            x = self.b(x)
        return x


class SkipAll(nn.Module):
    """The input is needed at the very end: one tensor never carries all state."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + x


class Residual(nn.Module):
    """A skip over `b` (so `b` and the add share a block) and glue between children."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        y = self.b(y) + y
        y = torch.relu(y) * self.scale
        return self.c(y)


class TwoInputs(nn.Module):
    """Two named inputs: block 0 takes both as keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x) * y))


def _declare(model: nn.Module, **inputs: tuple[str, list[int]]) -> nn.Module:
    model.flowmesh_inputs = {n: {"dtype": d, "shape": s} for n, (d, s) in inputs.items()}
    return model


def data_dependent() -> nn.Module:
    return _declare(DataDependent(), x=("float32", [-1, 4]))


def skip_all() -> nn.Module:
    return _declare(SkipAll(), x=("float32", [-1, 4]))


def residual() -> nn.Module:
    return _declare(Residual(), x=("float32", [-1, 4]))


def two_inputs() -> nn.Module:
    return _declare(TwoInputs(), x=("float32", [-1, 4]), y=("float32", [-1, 4]))


def undeclared() -> nn.Module:
    """A chain with no declared inputs: profiling gives bytes only."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.BatchNorm1d(4))
