"""Chains for Hugging Face causal language models (written against transformers 5.x).

Each block is a small wrapper holding references to the model's own submodules (no copies) and
taking one tensor: token ids into the first block, hidden states between blocks, logits out of
the last. What the model's top-level forward builds once and hands to every layer (positions and
the causal mask) each layer wrapper rebuilds from its input's shape, through the same
`create_causal_mask` the model calls, so every attention implementation gets the mask it expects.

Exactness (fp32, CPU, eager attention, no padding mask, no cache): the chain's output is
bit-identical to the model's `.logits` (tests/partitioner/test_chain.py asserts torch.equal): the
same kernels run on the same tensors in the same order; only where the mask and the position ids
are created changes. The Llama family (Llama, Qwen2, Mistral) also rebuilds each layer's rotary
position embeddings (see `Rope`). Out of scope: padding masks, KV caches, cross-attention, OPT
layerdrop during training.
"""

from __future__ import annotations

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.token_limits import TokenLimits, attach


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
    # Learned positions: a sequence longer than `wpe` has rows for cannot be embedded.
    limits = TokenLimits(t.wte.num_embeddings, t.wpe.num_embeddings)
    return [
        ("embed", attach(GPT2Embed(t.wte, t.wpe, t.drop), limits)),
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
        (
            "embed",
            attach(
                OPTEmbed(d.embed_tokens, d.embed_positions, d.project_in),
                # Learned positions (their table has 2 rows more: OPT's offset).
                TokenLimits(d.embed_tokens.num_embeddings, cfg.max_position_embeddings),
            ),
        ),
        *[(f"model.decoder.layers.{i}", OPTLayer(layer, cfg)) for i, layer in enumerate(d.layers)],
        ("head", OPTHead(d.final_layer_norm, d.project_out, model.lm_head)),
    ]


# -- Llama family (Llama, Qwen2, Mistral) ------------------------------------------------------
#
# Rotary position embeddings, RMSNorm, grouped-query attention. In transformers 5.x the model's
# forward computes the rotary `position_embeddings` (cos, sin) once with `model.model.rotary_emb`
# and hands them to every layer; each layer wrapper here recomputes them from its input's shape
# with a rotary module of the same class. That module's `inv_freq` is a non-persistent buffer:
# not in the weights files, and only a meta tensor in a model built on meta. So the wrappers do
# not hold the model's rotary module: `Rope` rebuilds it from the config (float32, as transformers
# computes it, whatever the model's dtype) once per device, outside the module tree, so no stage
# carries a tensor that no weights file holds.


class Rope:
    """The model's rotary embedding rebuilt from its config, one copy per device (not a module:
    its tiny buffers are derived data, never loaded, moved or counted as stage bytes)."""

    def __init__(self, config, rotary: nn.Module) -> None:
        self.config = config
        self.rotary_cls = type(rotary)
        self._on: dict[torch.device, nn.Module] = {}

    def on(self, device: torch.device) -> nn.Module:
        module = self._on.get(device)
        if module is None:
            with torch.device("cpu"):
                module = self.rotary_cls(config=self.config)
            module = self._on.setdefault(device, module.to(device))
        return module

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor):
        return self.on(hidden.device)(hidden, positions)


class DecoderEmbed(nn.Module):
    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids.view(-1, input_ids.shape[-1]))


class RopeLayer(nn.Module):
    """One decoder layer with positions, its causal mask (full or sliding window, as the model
    would choose for this layer) and rotary position embeddings rebuilt from its input."""

    def __init__(self, layer: nn.Module, config, rope: Rope, sliding: bool) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        self.rope = rope
        self.sliding = sliding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        if self.sliding:
            from transformers.masking_utils import create_sliding_window_causal_mask

            mask = create_sliding_window_causal_mask(
                config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None
            )
        else:
            mask = _causal_mask(self.config, hidden)
        return _first(
            self.layer(
                hidden,
                attention_mask=mask,
                position_ids=positions,
                use_cache=False,
                position_embeddings=self.rope(hidden, positions),
            )
        )


class NormHead(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _rope_chain(model: nn.Module, sliding: list[bool]) -> list[tuple[str, nn.Module]]:
    cfg = model.config
    m = model.model
    rope = Rope(cfg, m.rotary_emb)
    layers = list(m.layers[: cfg.num_hidden_layers])
    return [
        # Rotary positions: no table to run past, so only the vocabulary is a limit.
        ("embed", attach(DecoderEmbed(m.embed_tokens), TokenLimits(m.embed_tokens.num_embeddings))),
        *[
            (f"model.layers.{i}", RopeLayer(layer, cfg, rope, sliding[i]))
            for i, layer in enumerate(layers)
        ],
        ("head", NormHead(m.norm, model.lm_head)),
    ]


def llama(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """LlamaForCausalLM -> [embed_tokens, each decoder layer, norm+lm_head]."""
    return _rope_chain(model, [False] * model.config.num_hidden_layers)


def qwen2(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Qwen2ForCausalLM: as Llama; a layer's mask follows `config.layer_types` (full or
    sliding-window attention), as Qwen2Model.forward chooses it."""
    cfg = model.config
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    types = types[: cfg.num_hidden_layers]
    return _rope_chain(model, [t == "sliding_attention" for t in types])


def mistral(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """MistralForCausalLM: as Llama; every layer gets the sliding-window mask when
    `config.sliding_window` is set, as MistralModel.forward does."""
    cfg = model.config
    return _rope_chain(model, [cfg.sliding_window is not None] * cfg.num_hidden_layers)
