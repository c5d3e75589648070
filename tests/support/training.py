"""Training through a real mesh, held to plain PyTorch: the shared job, data and comparison.

Every training result is compared with the reference loop (`flowmesh.reference`) on the same
seed and data, with `torch.testing.assert_close` at rtol 1e-5 / atol 1e-6, never bit for bit.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from client_sdk.train_data import Dataset
from flowmesh.modelio.build import build_seeded
from flowmesh.modelio.chain import chain_of
from flowmesh.modelio.inputs import declared_inputs, make_inputs
from flowmesh.reference import cross_entropy, train
from flowmesh.spec import ModelSpec
from flowmesh.train_spec import TrainConfig
from gpu_worker.device import CpuStandIn
from gpu_worker.train_job import TrainingJob
from tests.support.train_grid import ALLOW as GRID_ALLOW
from tests.support.train_grid import MODELS

KIB = 1 << 10
RTOL, ATOL = 1e-5, 1e-6
TRAIN_BYTES = 96 * KIB  # two jobs' footprints (about 62 KiB each) do not fit together
CHUNK = 32 * KIB  # three sub-models per job
BATCH = 8
STEPS = 10
Data = list[tuple[torch.Tensor, torch.Tensor]]


def close(actual: Any, expected: Any, msg: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=msg)


def spec(seed: int) -> ModelSpec:
    return ModelSpec(
        name=f"mlp-{seed}",
        factory="flowmesh.examples:mlp",
        kwargs={"width": 32, "depth": 4, "in_features": 8, "out_features": 5},
        seed=seed,
    )


def data(seed: int, steps: int = STEPS) -> Data:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
        for _ in range(steps)
    ]


ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.05}
ADAM = {"name": "adam", "lr": 0.02}


def open_kw(s: ModelSpec, optimizer: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "kwargs": s.kwargs,
        "seed": s.seed,
        "optimizer": optimizer,
        "loss": "cross_entropy",
        "batch_size": BATCH,
        "chunk_bytes": CHUNK,
        "timeout": 60,
    }


def saved_state(path: str) -> dict[str, torch.Tensor]:
    tensors = load_file(str(Path(path) / "state.safetensors"))
    return {k: v for k, v in tensors.items() if "/" not in k}  # the model's, not optimizer/rng


# The default allow-list and the test factories (dropout and BatchNorm, for `job.eval`).
ALLOW_MODULES = ("flowmesh.examples", "torch.nn", "tests.support.train_models")
ALLOW = [a for module in ALLOW_MODULES for a in ("--allow", module)]  # broker and worker args


class Autocast(nn.Module):
    """`model` with its forward under `torch.autocast`, as an AMP user writes it around the
    forward: the parameters (the same objects, in the same order) stay float32, and the
    backward and the optimizer step, outside the forward, run on them as they are."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *args: Any) -> Any:
        with torch.autocast("cpu", dtype=self.dtype):
            return self.model(*args)


def plain(
    s: ModelSpec,
    optimizer: dict[str, Any],
    batches: Data,
    *,
    autocast: torch.dtype | None = None,
    **loop: Any,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """What a PyTorch user writes, in one process: `s`'s seeded model trained by the reference
    loop (`flowmesh.reference.train`, taking `loop`'s options); its losses and final state.
    With `autocast` (torch.bfloat16), plain AMP: the forward and the loss under
    `torch.autocast("cpu", dtype=autocast)`, the backward and the step outside it."""
    model = build_seeded(s, ALLOW_MODULES)
    if autocast is None:
        losses = train(model, optimizer, batches, **loop)
    else:
        loss = loop.pop("loss", cross_entropy)

        def amp_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=autocast):
                return loss(out, y)

        losses = train(Autocast(model, autocast), optimizer, batches, loss=amp_loss, **loop)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def teacher(rows: int = 320, seed: int = 1) -> Dataset:
    """Labels a random linear teacher gives: learnable, unlike random labels, so a good learning
    rate shows in the held-out loss (the sweep tests)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g)
    return Dataset({"": x}, (x @ torch.randn(8, 4, generator=g)).argmax(1), "teacher")


def job_of(
    model: str,
    cfg: TrainConfig,
    parts: int = 3,
    act_bytes: int | None = None,
    stash_copies: bool = False,
    name: str | None = None,
    device: CpuStandIn | None = None,
) -> TrainingJob:
    """The grid's `MODELS[model]` as a seeded in-process job (a CPU stand-in of 1 MiB), its chain
    cut into `parts` even sub-models; `act_bytes`: the activation bytes each sub-model's tasks
    reserve (None: none, as for a job built by hand); `stash_copies`: the stand-in copies
    stashes out and back into the arena as a device does (`CpuStandIn`); `name`: the job's
    (the model's by default); `device`: another job's, to run beside it."""
    if model == "hf-gpt2-tied":
        pytest.importorskip("transformers")
    spec = MODELS[model]
    net = build_seeded(spec, GRID_ALLOW)
    inputs = declared_inputs(spec, net)
    blocks = chain_of(net, make_inputs(inputs, 1, 1, "cpu") if inputs is not None else None)
    bounds = [round(i * len(blocks) / parts) for i in range(parts + 1)]
    return TrainingJob(
        name or model,
        blocks,
        list(pairwise(bounds)),
        cfg,
        device or CpuStandIn(1 << 20, stash_copies=stash_copies),
        inputs=inputs,
        allow=GRID_ALLOW,
        act_bytes=None if act_bytes is None else [act_bytes] * parts,
        fwd_bytes=None if act_bytes is None else [act_bytes] * parts,
    )
