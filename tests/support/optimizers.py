"""An optimizer torch does not ship, as a user brings one: Lion (Chen et al., 2023, "Symbolic
Discovery of Optimization Algorithms"), behind a factory `make(params, **options)`."""

from __future__ import annotations

from collections.abc import Iterable

import torch


class Lion(torch.optim.Optimizer):
    def __init__(
        self, params: Iterable[torch.Tensor], lr: float = 1e-4, betas=(0.9, 0.99), weight_decay=0.0
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def make(params: Iterable[torch.Tensor], **options) -> torch.optim.Optimizer:
    return Lion(params, **options)


def not_an_optimizer(params: Iterable[torch.Tensor], **options) -> object:
    return list(params)
