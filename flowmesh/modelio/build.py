"""Turning a ModelSpec into torch modules: on the meta device, seeded on the CPU, or from weights.

Every process that needs a module (partitioner, worker, tests, the demo's reference forward) builds
it here, so "the same model" means the same code path everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio import hf_dir
from flowmesh.modelio.dtypes import torch_dtype
from flowmesh.modelio.weights import read_weights
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec, check_factory, import_callable


def resolve_factory(factory: str, allow: Iterable[str] = DEFAULT_ALLOW) -> Callable[..., Any]:
    check_factory(factory, tuple(allow))
    return import_callable(factory, "factory")


def _call_factory(spec: ModelSpec, allow: Iterable[str]) -> nn.Module:
    fn = resolve_factory(spec.factory, allow)
    try:
        model = fn(**spec.kwargs)
    except FlowmeshError:
        raise
    except Exception as exc:
        raise FlowmeshError(
            Code.BAD_REQUEST, f"factory {spec.factory} failed: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(model, nn.Module):
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"factory {spec.factory} returned {type(model).__name__}, not a Module",
        )
    return model


def _cast(model: nn.Module, dtype: str) -> nn.Module:
    # Only floating tensors take the model dtype; integer buffers (positions, masks) keep theirs.
    return model.to(torch_dtype(dtype)).eval()


def build_meta(spec: ModelSpec, allow: Iterable[str] = DEFAULT_ALLOW) -> nn.Module:
    """The model's structure with no memory behind it."""
    if spec.hf is not None:
        return _cast(hf_dir.build_meta(spec.hf), spec.dtype)
    with torch.device("meta"):
        model = _call_factory(spec, allow)
    return _cast(model, spec.dtype)


def build_seeded(spec: ModelSpec, allow: Iterable[str] = DEFAULT_ALLOW) -> nn.Module:
    """The whole model on the CPU with the factory's own initialisation under `spec.init_seed`.

    This is the reference for seeded deployments: a worker holding any stage of the model has
    exactly the tensors this returns, so tests compare served outputs with its forward.
    A Hugging Face directory (`spec.hf`) has no seed: its model comes with its weights.
    """
    if spec.hf is not None:
        return build_reference(spec, allow)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.init_seed)
        with torch.device("cpu"):
            model = _call_factory(spec, allow)
    return _cast(model, spec.dtype)


def build_reference(spec: ModelSpec, allow: Iterable[str] = DEFAULT_ALLOW) -> nn.Module:
    """The whole model on the CPU as deployed: seeded, or with its weights file (or Hugging
    Face directory) loaded."""
    if spec.hf is not None:
        return hf_dir.load_whole(build_meta(spec, allow), spec.hf)
    if spec.weights is None:
        return build_seeded(spec, allow)
    model = build_meta(spec, allow)
    names = {n: n for n in model.state_dict(keep_vars=True)}
    tensors = read_weights(spec.weights, names, expected=model.state_dict(keep_vars=True))
    model.load_state_dict(tensors, assign=True, strict=True)
    return model.eval()
