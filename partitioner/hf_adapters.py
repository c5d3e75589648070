"""Chains for Hugging Face causal language models (written against transformers 5.x).

Each block is a small wrapper holding references to the model's own submodules (no copies) and
taking one tensor: token ids into the first block, hidden states between blocks, logits out of
the last. What the model's top-level forward builds once and hands to every layer (positions and
the causal mask) each layer wrapper rebuilds from its input's shape, through the same
`create_causal_mask` the model calls, so every attention implementation gets the mask it expects.

Exactness (fp32, CPU, eager attention, no padding mask, no cache): the chain's output is
bit-identical to the model's `.logits` (tests/partitioner/test_chain.py asserts torch.equal): the
same kernels run on the same tensors in the same order; only where the mask and the position ids
are created changes. Out of scope: padding masks, KV caches, cross-attention, OPT layerdrop
during training.
"""

from __future__ import annotations

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError


def _causal_mask(config, hidden: torch.Tensor) -> torch.Tensor | None:
    from transformers.masking_utils import create_causal_mask

    # No position ids: the models pass plain 0..T-1 positions, for which the mask is the same,
    # and looking for packed sequences in them would read tensor values (impossible on meta).
    return create_causal_mask(config=config, inputs_embeds=hidden, attention_mask=None, cache=None)


def _first(out):
    # transformers 4.x layers return tuples, 5.x a tensor.
    return out[0] if isinstance(out, tuple) else out


# -- GPT-2 ---------------------------------------------------------------------------------


class GPT2Embed(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        embeds = self.wte(input_ids)
        positions = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
        return self.drop(embeds + self.wpe(positions))


class GPT2Layer(nn.Module):
    def __init__(self, layer: nn.Module, config) -> None:
        super().__init__()
        self.layer = layer
        self.config = config  # not a module: holds no tensors

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = _causal_mask(self.config, hidden)
        return _first(
            self.layer(hidden, attention_mask=mask, position_ids=positions, use_cache=False)
        )


class GPT2Head(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def gpt2(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """GPT2LMHeadModel -> [wte+wpe, each transformer block, ln_f+lm_head]."""
    cfg = model.config
    if getattr(cfg, "add_cross_attention", False):
        raise FlowmeshError(
            Code.NOT_A_CHAIN, "GPT-2 with cross-attention takes two inputs; not a chain"
        )
    t = model.transformer
    return [
        ("embed", GPT2Embed(t.wte, t.wpe, t.drop)),
        *[(f"transformer.h.{i}", GPT2Layer(layer, cfg)) for i, layer in enumerate(t.h)],
        ("head", GPT2Head(t.ln_f, model.lm_head)),
    ]


# -- OPT -----------------------------------------------------------------------------------


class OPTEmbed(nn.Module):
    def __init__(
        self, embed_tokens: nn.Module, embed_positions: nn.Module, project_in: nn.Module | None
    ) -> None:
        super().__init__()
        self.embed_tokens, self.embed_positions = embed_tokens, embed_positions
        self.project_in = project_in

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        embeds = self.embed_tokens(input_ids)
        b, t = input_ids.shape
        # OPT's learned positions: cumsum of an all-ones mask minus one, i.e. 0..T-1 per row.
        ones = torch.ones(b, t, device=embeds.device)
        positions = (torch.cumsum(ones, dim=1) * ones - 1).long()
        pos_embeds = self.embed_positions(ones, 0, position_ids=positions)
        if self.project_in is not None:
            embeds = self.project_in(embeds)
        return embeds + pos_embeds


class OPTLayer(nn.Module):
    def __init__(self, layer: nn.Module, config) -> None:
        super().__init__()
        self.layer = layer
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t = hidden.shape[:2]
        positions = torch.arange(t, device=hidden.device).unsqueeze(0).expand(b, t)
        mask = _causal_mask(self.config, hidden)
        return _first(
            self.layer(hidden, attention_mask=mask, position_ids=positions, use_cache=False)
        )


class OPTHead(nn.Module):
    def __init__(
        self, final_layer_norm: nn.Module | None, project_out: nn.Module | None, lm_head: nn.Module
    ) -> None:
        super().__init__()
        self.final_layer_norm, self.project_out, self.lm_head = (
            final_layer_norm,
            project_out,
            lm_head,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return self.lm_head(hidden).contiguous()


def opt(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """OPTForCausalLM -> [embed_tokens+embed_positions(+project_in), each decoder layer,
    final_layer_norm(+project_out)+lm_head]."""
    d = model.model.decoder
    cfg = model.config
    return [
        ("embed", OPTEmbed(d.embed_tokens, d.embed_positions, d.project_in)),
        *[(f"model.decoder.layers.{i}", OPTLayer(layer, cfg)) for i, layer in enumerate(d.layers)],
        ("head", OPTHead(d.final_layer_norm, d.project_out, model.lm_head)),
    ]
