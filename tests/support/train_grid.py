"""The training exactness grid's models, optimizers, data and plain PyTorch reference, shared by
the grid (tests/scenarios/test_training_exactness.py) and the scenario of jobs opened while
another trains (tests/scenarios/test_open_while_training.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowmesh.modelio.build import build_seeded
from flowmesh.reference import train
from flowmesh.spec import ModelSpec

KIB = 1 << 10
RTOL, ATOL = 1e-5, 1e-6
STEPS = 20
BATCH = 8
SEQ = 6
VOCAB = 40
RNG_SEED = 21  # every job's own random stream (dropout), as `rng_seed=` of train_open
TRAIN_BYTES = 512 * KIB  # far below the 96 jobs' footprints together: memory flows between them
ALLOW = ("flowmesh.examples", "torch.nn", "tests.support.train_models")

MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(
        name="mlp",
        factory="flowmesh.examples:mlp",
        kwargs={"width": 32, "depth": 4, "in_features": 8, "out_features": 5},
        seed=3,
    ),
    "gpt-dropout": ModelSpec(
        name="gpt-dropout",
        factory="tests.support.train_models:dropout_gpt",
        kwargs={"vocab": VOCAB, "d_model": 16, "n_layers": 2, "n_heads": 2},
        seed=4,
    ),
    "resnet-bn": ModelSpec(
        name="resnet-bn",
        factory="flowmesh.examples:small_resnet",
        kwargs={"num_classes": 5, "width": 4, "blocks": [1, 1, 1], "image": 8},
        seed=5,
    ),
    "hf-gpt2-tied": ModelSpec(
        name="hf-gpt2-tied",
        factory="flowmesh.examples:hf_gpt2",
        kwargs={"n_layer": 2, "n_embd": 16, "n_head": 2, "vocab_size": VOCAB, "n_positions": 16},
        seed=6,
    ),
}
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd+momentum": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
    "adam": {"name": "adam", "lr": 0.01},
    "adamw": {"name": "adamw", "lr": 0.01, "weight_decay": 0.05},
}
Data = list[tuple[torch.Tensor, torch.Tensor]]


def data_for(model: str, seed: int) -> Data:
    g = torch.Generator().manual_seed(seed)
    out: Data = []
    for _ in range(STEPS):
        if model in ("gpt-dropout", "hf-gpt2-tied"):
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            out.append((ids, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)))
        elif model == "resnet-bn":
            x = torch.randn(BATCH, 3, 8, 8, generator=g)
            out.append((x, torch.randint(0, 5, (BATCH,), generator=g)))
        else:
            x = torch.randn(BATCH, 8, generator=g)
            out.append((x, torch.randint(0, 5, (BATCH,), generator=g)))
    return out


@dataclass
class Plain:
    losses: list[float]
    state: dict[str, torch.Tensor]
    params: set[str]


def plain_run(model_name: str, optimizer: dict[str, Any], clip: float | None, data: Data) -> Plain:
    """What a PyTorch user writes: zero_grad, loss, backward, clip by global norm, step."""
    model: nn.Module = build_seeded(MODELS[model_name], ALLOW)
    losses = train(model, optimizer, data, clip=clip, rng_seed=RNG_SEED)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Plain(losses, state, {n for n, _ in model.named_parameters()})
