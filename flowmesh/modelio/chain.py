"""Reading a model as an ordered chain of blocks, without touching memory (works on meta modules).

Block 0 takes the model's inputs (one tensor positionally, several as keyword arguments, as
`inputs.call_model` passes them); every later block takes the previous block's single tensor.
Running the blocks in order computes what the model computes (for architectures read through an
adapter, the model's main output: logits for causal language models).

The chain is found by the first of these that applies:
  (a) an `nn.Sequential` (with the stock forward): its children, nested plain Sequentials opened;
  (b) a registered architecture adapter, looked up along the model class's MRO;
  (c) a torch.fx trace of the forward with the direct children as leaves (`modelio.fx_chain`);
  (d) otherwise the whole model as one block, which still serves as a single stage; the block's
      `uncut` says why it could not be cut, and planners asked for more than one part raise a
      NOT_A_CHAIN error with that reason and what to do (`whole=False` raises it at once).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.fx_chain import fx_chain
from flowmesh.modelio.inputs import call_model
from flowmesh.modelio.sequential import is_plain_sequential, sequential_leaves


@dataclass
class Block:
    """One link of the chain.

    `tensor_names` maps every name in `module.state_dict(keep_vars=True)` to the name of the same
    tensor in the original model's `state_dict()`, so a worker can read exactly the block's
    tensors from a safetensors file of the whole model (or copy them from a whole model).
    """

    name: str
    module: nn.Module
    tensor_names: dict[str, str]
    uncut: str | None = None  # set on a whole-model block: why the model could not be cut


# An adapter turns a model into (name, module) pairs whose modules hold references to the model's
# own submodules, so no tensor is copied.
Adapter = Callable[[nn.Module], list[tuple[str, nn.Module]]]

# Keyed by "module.QualName" of the class so that registering costs no import of the library;
# values are adapters or "module:function" strings imported on first use.
_ADAPTERS: dict[str, Adapter | str] = {
    "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel": "flowmesh.modelio.hf_adapters:gpt2",
    "transformers.models.opt.modeling_opt.OPTForCausalLM": "flowmesh.modelio.hf_adapters:opt",
    "transformers.models.llama.modeling_llama.LlamaForCausalLM": (
        "flowmesh.modelio.hf_adapters:llama"
    ),
    "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM": (
        "flowmesh.modelio.hf_adapters:qwen2"
    ),
    "transformers.models.mistral.modeling_mistral.MistralForCausalLM": (
        "flowmesh.modelio.hf_adapters:mistral"
    ),
}


def register_adapter(cls: type | str, adapter: Adapter | str) -> None:
    """Teach `chain_of` an architecture: `cls` is a class or its "module.QualName"."""
    key = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    _ADAPTERS[key] = adapter


def adapter_classes() -> list[str]:
    """The "module.QualName" of every class with a registered adapter (subclasses use it too)."""
    return list(_ADAPTERS)


def _find_adapter(model: nn.Module) -> Adapter | None:
    for cls in type(model).__mro__:
        key = f"{cls.__module__}.{cls.__qualname__}"
        found = _ADAPTERS.get(key)
        if found is None:
            continue
        if isinstance(found, str):
            module_name, attr = found.split(":", 1)
            found = getattr(importlib.import_module(module_name), attr)
            _ADAPTERS[key] = found
        return found
    return None


def first_names(model: nn.Module) -> dict[int, str]:
    """id(tensor) -> the first name `model.state_dict()` lists for it (tied tensors have several;
    safetensors files of Hugging Face models keep only the first)."""
    out: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        out.setdefault(id(tensor), name)
    return out


def map_tensor_names(
    block_name: str, module: nn.Module, originals: dict[int, str]
) -> dict[str, str]:
    """Each of `module`'s state_dict names -> the original model's name, matched by identity."""
    out: dict[str, str] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        original = originals.get(id(tensor))
        if original is None:
            raise FlowmeshError(
                Code.NOT_A_CHAIN,
                f"block {block_name!r} holds tensor {name!r}, which is not in the model's "
                "state_dict (a plain tensor attribute or a constant captured while tracing), so "
                "no weights file can fill it; register it as a parameter or persistent buffer",
            )
        out[name] = original
    return out


def _blocks(model: nn.Module, pairs: list[tuple[str, nn.Module]]) -> list[Block]:
    originals = first_names(model)
    return [
        Block(name, module, map_tensor_names(name, module, originals)) for name, module in pairs
    ]


def chain_of(
    model: nn.Module, example: dict[str, torch.Tensor] | None = None, *, whole: bool = True
) -> list[Block]:
    """The model as an ordered list of blocks (see the module docstring for the order of tries).

    `example` (inputs on the model's device) lets the fx path check that every cut carries a
    tensor; without it the model's declared `flowmesh_inputs` are used when it has them.
    """
    if is_plain_sequential(model):
        if len(model) == 0:
            raise FlowmeshError(Code.NOT_A_CHAIN, "the model is an empty nn.Sequential")
        return _blocks(model, sequential_leaves(model))  # type: ignore[arg-type]
    adapter = _find_adapter(model)
    if adapter is not None:
        return _blocks(model, adapter(model))
    try:
        return _blocks(model, fx_chain(model, example))
    except FlowmeshError as exc:
        if not whole or exc.code != Code.NOT_A_CHAIN:
            raise
        (block,) = _blocks(model, [("model", model)])
        block.uncut = exc.reason
        return [block]


def run_chain(blocks: list[Block], inputs: dict[str, torch.Tensor] | torch.Tensor) -> Any:
    """Run blocks in order: the first on the model's inputs, each later on the previous output."""
    out = call_model(blocks[0].module, inputs)
    for block in blocks[1:]:
        out = block.module(out)
    return out
