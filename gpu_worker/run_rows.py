"""A run's rows: the parts of the requests batched into one run, checked and concatenated into
the stage's inputs, and its outputs split back into one part per request (the executor's and
the worker core's direct runs share this)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from flowmesh.errors import Code, FlowmeshError
from flowmesh.messages import GenStep
from flowmesh.modelio.token_limits import TokenLimits


def concat_parts(parts: list[Mapping[str, Any]], device: torch.device) -> tuple[Any, list[int]]:
    """Concatenate the parts' inputs along dim 0; returns the inputs and rows per part."""
    if len(parts) == 1:  # a run of one request, the common case: nothing to concatenate
        merged = {n: on_device(as_tensor(t), device) for n, t in parts[0].items()}
        if not merged:
            raise FlowmeshError(Code.BAD_REQUEST, "a part of a run has no inputs")
        first = next(iter(merged.values()))
        return merged, [int(first.shape[0]) if first.dim() else 1]
    tensors = [{n: as_tensor(t) for n, t in p.items()} for p in parts]
    names = list(tensors[0])
    for p in tensors[1:]:
        if list(p) != names:
            raise FlowmeshError(Code.BAD_REQUEST, "parts of a batch name different inputs")
    rows = [int(p[names[0]].shape[0]) if p[names[0]].dim() else 1 for p in tensors]
    merged = {n: on_device(torch.cat([p[n] for p in tensors], dim=0), device) for n in names}
    return merged, rows


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


def part_rows(parts: list[Mapping[str, Any]]) -> int:
    """The rows of a run's parts (dim 0 of each part's first input; a scalar is one row), read
    from shapes only: a received TensorRef has one without becoming a tensor."""
    rows = 0
    for part in parts:
        for t in part.values():
            shape = t.shape
            rows += int(shape[0]) if len(shape) else 1
            break
    return rows


def checked_parts(limits: TokenLimits, parts: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The parts as tensors, each checked against the stage's limits where it arrived (host
    memory: no device synchronisation); raises BAD_REQUEST naming what the model cannot take."""
    out = []
    for part in parts:
        tensors = {n: as_tensor(t) for n, t in part.items()}
        limits.check(tensors)
        out.append(tensors)
    return out


def as_tensor(t: Any) -> torch.Tensor:
    """A received TensorRef's tensor, or the tensor itself."""
    return t.tensor() if hasattr(t, "tensor") else t


def named_outputs(x: Any) -> dict[str, torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return {"": x}
    if isinstance(x, Mapping):
        out = {k: v for k, v in x.items() if isinstance(v, torch.Tensor)}
        if out:
            return out
    raise FlowmeshError(
        Code.MODEL_ERROR, f"model returned {type(x).__name__}; expected a tensor or a dict of them"
    )


def split_rows(outputs: dict[str, torch.Tensor], rows: list[int]) -> list[dict[str, torch.Tensor]]:
    if len(rows) == 1:
        return [outputs]
    total = sum(rows)
    parts: list[dict[str, torch.Tensor]] = [{} for _ in rows]
    for name, t in outputs.items():
        if t.dim() == 0 or t.shape[0] != total:
            raise FlowmeshError(
                Code.MODEL_ERROR,
                f"output {name!r} has shape {tuple(t.shape)}, not batch-first over {total} rows; "
                "deploy this model with max_batch_size=1",
            )
        for i, piece in enumerate(torch.split(t, rows, dim=0)):
            parts[i][name] = piece
    return parts


def gen_input(
    where: str, limits: TokenLimits | None, parts: list[Mapping[str, Any]], gen: GenStep
) -> torch.Tensor:
    """A generation run's one tensor, checked against its iteration: stage 0's packed token
    ids (int64 `[tokens]`, within the vocabulary), a later stage's hidden states
    `[tokens, hidden]`; `where` names the stage, `limits` are stage 0's (None on later stages)."""
    if len(parts) != 1 or len(parts[0]) != 1:
        raise FlowmeshError(
            Code.BAD_REQUEST, f"{where}: a generation run takes one part with one tensor"
        )
    if not gen.seqs:
        raise FlowmeshError(Code.BAD_REQUEST, f"{where}: a generation run needs sequences")
    if len({s.seq for s in gen.seqs}) != len(gen.seqs):
        raise FlowmeshError(Code.BAD_REQUEST, f"{where}: a sequence is twice in one iteration")
    ((name, ref),) = parts[0].items()
    x = as_tensor(ref)
    total = sum(s.count for s in gen.seqs)
    if limits is not None:
        if x.dim() != 1:
            raise FlowmeshError(
                Code.BAD_REQUEST, f"{where}: token ids must be 1-D, got shape {tuple(x.shape)}"
            )
        # Positions are each sequence's own (the broker keeps them within the model's table):
        # the packed run is as long as all its sequences' new tokens together.
        replace(limits, positions=None).check({name: x})
        for s in gen.seqs:
            if limits.positions is not None and s.start + s.count > limits.positions:
                raise FlowmeshError(
                    Code.BAD_REQUEST,
                    f"{where}: sequence {s.seq} would take {s.start + s.count} positions, the "
                    f"model takes at most {limits.positions}",
                )
    elif x.dim() != 2:
        raise FlowmeshError(
            Code.BAD_REQUEST, f"{where}: hidden states must be 2-D, got shape {tuple(x.shape)}"
        )
    if x.shape[0] != total:
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"{where}: {x.shape[0]} tokens in the run, its sequences have {total} new ones",
        )
    return x
