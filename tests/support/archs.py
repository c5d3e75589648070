"""Specs and inputs of the supported architectures, for the partitioner's and worker's tests."""

from __future__ import annotations

import torch

from flowmesh.spec import ModelSpec

# name -> factory kwargs: small enough for a 2-core CPU.
ARCHS: dict[str, dict] = {
    "mlp": {"width": 32, "depth": 3},
    "tiny_gpt": {"vocab": 64, "d_model": 32, "n_layers": 3, "n_heads": 4, "max_len": 16},
    "small_resnet": {"width": 8, "blocks": [1, 1, 1], "image": 16},
    "hf_gpt2": {"n_layer": 3, "n_embd": 32, "n_head": 4, "vocab_size": 97, "n_positions": 16},
    "hf_opt": {
        "num_hidden_layers": 3,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "vocab_size": 97,
        "max_position_embeddings": 16,
    },
}


def spec_of(arch: str, **fields) -> ModelSpec:
    fields.setdefault("seed", 7)
    return ModelSpec(name=arch, factory=f"flowmesh.examples:{arch}", kwargs=ARCHS[arch], **fields)


def inputs_of(arch: str, batch: int = 2) -> torch.Tensor:
    """A deterministic example input for `arch` (token ids or floats)."""
    g = torch.Generator().manual_seed(11)
    if arch == "mlp":
        return torch.randn(batch, 32, generator=g)
    if arch == "small_resnet":
        return torch.randn(batch, 3, 16, 16, generator=g)
    vocab = ARCHS[arch].get("vocab", ARCHS[arch].get("vocab_size"))
    return torch.randint(0, vocab, (batch, 9), generator=g)


def model_output(arch: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's own forward (logits for the Hugging Face models)."""
    out = model(input_ids=x) if arch.startswith("hf_") else model(x)
    return out.logits if arch.startswith("hf_") else out
