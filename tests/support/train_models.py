"""Model factories the tests add to the mesh's allow-list (`--allow tests.support.train_models`):
one with dropout and BatchNorm (an eval must switch both off), one whose own code raises on a
marked input value (isolation of a failing job), one that raises deep inside on a NaN (a failure
in the middle of a pipeline), one whose forward takes milliseconds whatever the machine (a slow
model), one that takes two keyword inputs, one with buffers outside its state_dict."""

from __future__ import annotations

import time

import torch
from torch import nn

MARK = 12345.0  # an input holding this value makes `boom_mlp`'s first block raise


def _declare(model: nn.Module) -> nn.Module:
    model.flowmesh_inputs = {"x": {"dtype": "float32", "shape": [-1, 8]}}  # type: ignore[assignment]
    return model


def dropout_bn_mlp() -> nn.Module:
    return _declare(
        nn.Sequential(
            # No bias before BatchNorm: its gradient would be rounding noise, which Adam
            # scales up to a full step of arbitrary sign (thread counts would then decide it).
            nn.Linear(8, 16, bias=False),
            nn.BatchNorm1d(16),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(16, 16),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(16, 5),
        )
    )


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The planner traces shapes on the meta device, where values cannot be read.
        if x.device.type != "meta" and bool((x == MARK).any()):
            raise RuntimeError("boom: the model's own code failed")
        return x


def boom_mlp() -> nn.Module:
    return _declare(
        nn.Sequential(
            Boom(), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 5)
        )
    )


class BoomOnNaN(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta" and bool(torch.isnan(x).any()):
            raise RuntimeError("boom: a NaN reached the middle of the model")
        return x


def late_boom_mlp() -> nn.Module:
    """Six blocks; the fourth raises when a NaN reaches it (a NaN input survives the Linears
    before it), so cut in three stages the failure is in the middle one."""
    return _declare(
        nn.Sequential(
            nn.Linear(8, 8),
            nn.GELU(),
            nn.Linear(8, 8),
            BoomOnNaN(),
            nn.Linear(8, 8),
            nn.Linear(8, 5),
        )
    )


def dropout_gpt(
    vocab: int = 40, d_model: int = 16, n_layers: int = 2, n_heads: int = 2
) -> nn.Module:
    """`flowmesh.examples.tiny_gpt` with dropout after the embedding and every block: the
    recompute of a sub-model's forward must replay the same masks."""
    from flowmesh.examples import DecoderBlock, LMHead, TokenEmbedding

    layers: list[nn.Module] = [TokenEmbedding(vocab, d_model, 16), nn.Dropout(0.1)]
    for _ in range(n_layers):
        layers += [DecoderBlock(d_model, n_heads), nn.Dropout(0.1)]
    model = nn.Sequential(*layers, LMHead(d_model, vocab))
    model.flowmesh_inputs = {"ids": {"dtype": "int64", "shape": [-1, -1]}}  # type: ignore[assignment]
    return model


class Pause(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            time.sleep(self.seconds)
        return x


def slow_mlp(pause_ms: float = 5.0) -> nn.Module:
    """A small MLP that pauses `pause_ms` in its forward: a run never counts as quick."""
    return _declare(nn.Sequential(nn.Linear(8, 16), Pause(pause_ms / 1000), nn.Linear(16, 5)))


class Gated(nn.Module):
    """Two keyword inputs, as a Hugging Face model takes `input_ids` and `attention_mask`: its
    first block reads both."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Linear(8, 16)
        self.gate = nn.Linear(4, 16)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.body(self.value(x) * torch.sigmoid(self.gate(mask)))


def gated_mlp() -> nn.Module:
    model = Gated()
    model.flowmesh_inputs = {  # type: ignore[assignment]
        "x": {"dtype": "float32", "shape": [-1, 8]},
        "mask": {"dtype": "float32", "shape": [-1, 4]},
    }
    return model


class Masked(nn.Module):
    """A linear layer under a fixed mask kept as a non-persistent buffer (as causal masks and
    rotary caches are): in no state_dict, held all the same."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("mask", torch.tril(torch.ones(width, width)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(nn.functional.linear(x, self.lin.weight * self.mask, self.lin.bias))


def masked_mlp(width: int = 32, depth: int = 4) -> nn.Module:
    blocks = [nn.Linear(8, width), *(Masked(width) for _ in range(depth)), nn.Linear(width, 5)]
    return _declare(nn.Sequential(*blocks))
