"""What a language model's token-id input can take, checked before a stage computes anything.

An id outside the embedding, or a sequence longer than a table of learned positions, would make
the first block's embedding lookup fail deep inside the model (`IndexError: index out of range in
self`), after the run had started. The architecture adapters (`flowmesh.modelio.hf_adapters`)
attach a `TokenLimits` to the block that embeds the ids, and the worker's executor checks every
part of a run against it before the forward (`limits_of`), answering BAD_REQUEST with the input,
the offending value and the limit.

The check reads the ids where they arrived (host memory), so it costs no device synchronisation:
a min and a max over the batch's ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError

# The attribute of a block holding its limits (a plain attribute: no tensors, never loaded).
ATTR = "flowmesh_limits"


@dataclass(frozen=True)
class TokenLimits:
    """Token ids in [0, vocab); at most `positions` of them per sequence (None: no table of
    positions to run past, as with rotary embeddings). `name`: the model's declared input, used
    when a run's input came unnamed."""

    vocab: int
    positions: int | None = None
    name: str = "input_ids"

    def check(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Raise BAD_REQUEST naming the input, the value and the limit, for the first input
        the model cannot take."""
        for key, ids in inputs.items():
            label = f"input {key or self.name!r}"
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                dtype = str(ids.dtype).removeprefix("torch.")
                raise FlowmeshError(
                    Code.BAD_REQUEST, f"{label}: token ids must be integers, got {dtype}"
                )
            if ids.dim() == 0:
                raise FlowmeshError(Code.BAD_REQUEST, f"{label}: token ids need a sequence dim")
            length = int(ids.shape[-1])
            if self.positions is not None and length > self.positions:
                raise FlowmeshError(
                    Code.BAD_REQUEST,
                    f"{label}: {length} positions, the model takes at most {self.positions}",
                )
            if ids.numel() == 0:
                continue
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab:
                bad = low if low < 0 else high
                raise FlowmeshError(
                    Code.BAD_REQUEST,
                    f"{label}: token id {bad} outside the vocabulary ({self.vocab} tokens)",
                )


def attach(block: nn.Module, limits: TokenLimits) -> nn.Module:
    """`block` with `limits` attached (see `limits_of`)."""
    setattr(block, ATTR, limits)
    return block


def limits_of(block: nn.Module) -> TokenLimits | None:
    """The limits attached to `block`: set on the block that embeds a model's token ids, so a
    stage whose first block has them is the one that takes the ids."""
    found = getattr(block, ATTR, None)
    return found if isinstance(found, TokenLimits) else None
