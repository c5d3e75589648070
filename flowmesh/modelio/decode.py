"""A stage's chain blocks run for generation: packed sequences, keys and values kept per sequence.

One iteration of generation carries the new tokens of several sequences one after the other
(`packed`): the whole prompt of a sequence joining (prefill), one token of each sequence already
running (decode). Token ids go into the first block (1-D), hidden states `[tokens, hidden]`
between blocks; the head returns the logits of each sequence's last new token only.

The blocks are the Llama family's chain (`flowmesh.modelio.hf_adapters`: DecoderEmbed,
RopeLayer, NormHead), GPT-2's (GPT2Embed with its learned positions, GPT2Layer, GPT2Head) or
OPT's (OPTEmbed, OPTLayer, OPTHead),
run here through the layer's own submodules: norms, projections and MLP
batched over every packed token, attention per sequence against its cached keys and values plus
the new ones, under the causal mask offset by the tokens already cached (and the sliding window
where the chain gives the layer one), with the eager attention's math (scores in the model's
dtype, softmax in float32 for the Llama family and OPT and in the scores' dtype for GPT-2, as each
model's own eager attention does). So a sequence's logits match the model's own forward, and HF
`generate` with its cache, within the tolerance rule, whatever else is in the batch.

The keys and values live in blocks of `KV_BLOCK` tokens (`gpu_worker.kv_cache`): each block one
tensor `[layers, 2, kv_heads, KV_BLOCK, head_dim]` holding all of a stage's attention layers, so
one block is one allocation of the worker's arena. Which blocks a sequence has is its
`SeqCache`; this module only reads and writes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.hf_adapters import (
    DecoderEmbed,
    GPT2Embed,
    GPT2Head,
    GPT2Layer,
    NormHead,
    OPTEmbed,
    OPTHead,
    OPTLayer,
    RopeLayer,
)

KV_BLOCK = 16  # tokens per block of the KV cache

# What generation runs, by block class (the error names them).
SUPPORTED = (
    DecoderEmbed,
    RopeLayer,
    NormHead,
    GPT2Embed,
    GPT2Layer,
    GPT2Head,
    OPTEmbed,
    OPTLayer,
    OPTHead,
)
SUPPORTED_MODELS = "Llama, Qwen2, Mistral, GPT-2 and OPT"
ATTENTION = (RopeLayer, GPT2Layer, OPTLayer)  # the blocks that keep keys and values
HEADS = (NormHead, GPT2Head, OPTHead)  # the blocks that end a chain in logits


@dataclass(frozen=True)
class KVShape:
    """The keys and values a stage keeps per token: `layers` attention layers of `kv_heads` x
    `head_dim`, in `dtype` (the layers' own)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, KV_BLOCK, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of `KV_BLOCK` tokens (0 for a stage without attention layers)."""
        return self.layers * 2 * self.kv_heads * KV_BLOCK * self.head_dim * self.dtype.itemsize


def kv_shape(blocks: list[nn.Module]) -> KVShape:
    """The KV a stage of these blocks keeps per token; BAD_REQUEST for a block generation does
    not run (naming them)."""
    unsupported = sorted({type(b).__name__ for b in blocks if not isinstance(b, SUPPORTED)})
    if unsupported:
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"generation supports {SUPPORTED_MODELS} models (blocks "
            f"{', '.join(c.__name__ for c in SUPPORTED)}); this stage has: "
            f"{', '.join(unsupported)}",
        )
    layers = [b for b in blocks if isinstance(b, ATTENTION)]
    if not layers:
        return KVShape(0, 0, 0, torch.float32)
    first = layers[0]
    if isinstance(first, GPT2Layer):
        attn = first.layer.attn
        return KVShape(len(layers), attn.num_heads, attn.head_dim, attn.c_attn.weight.dtype)
    attn = first.layer.self_attn
    if isinstance(first, OPTLayer):
        return KVShape(len(layers), attn.num_heads, attn.head_dim, attn.k_proj.weight.dtype)
    kv_heads = attn.k_proj.out_features // attn.head_dim
    return KVShape(len(layers), kv_heads, attn.head_dim, attn.k_proj.weight.dtype)


@dataclass
class SeqCache:
    """One sequence's KV on one stage: its blocks (each `KVShape.block_shape`), enough for the
    tokens it will have after this iteration."""

    blocks: list[torch.Tensor]


@dataclass(frozen=True)
class Packed:
    """Where each sequence's new tokens are in a packed iteration: `start` (the tokens before
    it are cached) and `count` per sequence, in order. It also keeps what every layer of the
    iteration would otherwise compute again (`once`): the tokens' positions, the rotary cos and
    sin (the model's forward computes those once for all its layers, too)."""

    starts: list[int]
    counts: list[int]
    _once: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def once(self, key: Any, make: Callable[[], Any]) -> Any:
        """`make()`, computed at the first call with `key` in this iteration."""
        if key not in self._once:
            self._once[key] = make()
        return self._once[key]

    @property
    def total(self) -> int:
        return sum(self.counts)

    def offsets(self) -> list[int]:
        out, o = [], 0
        for c in self.counts:
            out.append(o)
            o += c
        return out


def gen_forward(
    blocks: list[nn.Module], x: torch.Tensor, packed: Packed, caches: list[SeqCache]
) -> torch.Tensor:
    """`x` (token ids `[tokens]` into an embedding block, else hidden `[tokens, hidden]`)
    through `blocks`, writing each attention layer's new keys and values into `caches` (one per
    sequence, in `packed` order). Returns the hidden states, or after a head the logits of
    each sequence's last new token `[sequences, vocab]`."""
    layer = 0
    for block in blocks:
        x = block_step(block, x, packed, caches, layer)
        if isinstance(block, ATTENTION):
            layer += 1
    return x


def block_step(
    block: nn.Module, x: torch.Tensor, packed: Packed, caches: list[SeqCache], layer: int
) -> torch.Tensor:
    """One block of `gen_forward`; `layer`: its index among the stage's attention layers."""
    if isinstance(block, DecoderEmbed):
        return block.embed_tokens(x.reshape(-1))
    if isinstance(block, RopeLayer):
        return _layer(block, x, packed, caches, layer)
    if isinstance(block, NormHead):
        return block.lm_head(block.norm(_last_tokens(x, packed)))
    if isinstance(block, GPT2Embed):
        ids = x.reshape(-1)
        return block.drop(block.wte(ids) + block.wpe(positions_of(packed, ids.device)))
    if isinstance(block, GPT2Layer):
        return _gpt2_layer(block, x, packed, caches, layer)
    if isinstance(block, GPT2Head):
        return block.lm_head(block.ln_f(_last_tokens(x, packed)))
    if isinstance(block, OPTEmbed):
        ids = x.reshape(-1)
        embeds = block.embed_tokens(ids)
        if block.project_in is not None:
            embeds = block.project_in(embeds)
        # OPT's learned positions (the table's own offset of 2 added by it).
        positions = positions_of(packed, ids.device).unsqueeze(0)
        return embeds + block.embed_positions(None, 0, position_ids=positions)[0]
    if isinstance(block, OPTLayer):
        return _opt_layer(block, x, packed, caches, layer)
    if isinstance(block, OPTHead):
        h = _last_tokens(x, packed)
        if block.final_layer_norm is not None:
            h = block.final_layer_norm(h)
        if block.project_out is not None:
            h = block.project_out(h)
        return block.lm_head(h)
    kv_shape([block])  # raises, naming it
    raise AssertionError(type(block))


def _last_tokens(x: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The hidden states of each sequence's last new token `[sequences, hidden]`."""
    last = torch.tensor(
        [o + c - 1 for o, c in zip(packed.offsets(), packed.counts, strict=True)],
        device=x.device,
    )
    return x.index_select(0, last)


def positions_of(packed: Packed, device: torch.device) -> torch.Tensor:
    """Each packed token's position in its sequence."""
    return torch.cat(
        [
            torch.arange(s, s + c, device=device)
            for s, c in zip(packed.starts, packed.counts, strict=True)
        ]
    )


def _layer(
    block: RopeLayer, x: torch.Tensor, packed: Packed, caches: list[SeqCache], layer: int
) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    decoder = block.layer
    attn = decoder.self_attn
    n, hd = x.shape[0], attn.head_dim
    h = decoder.input_layernorm(x)
    # [1, heads, tokens, head_dim], as the model's attention has them (a batch of one row).
    q = attn.q_proj(h).view(1, n, -1, hd).transpose(1, 2)
    k = attn.k_proj(h).view(1, n, -1, hd).transpose(1, 2)
    v = attn.v_proj(h).view(1, n, -1, hd).transpose(1, 2)
    # The same for every layer of the iteration (one `Rope` per model; cos and sin in h's
    # dtype, on its device).
    cos, sin = packed.once(
        (block.rope, h.dtype, h.device),
        lambda: block.rope(h.unsqueeze(0), positions_of(packed, x.device).unsqueeze(0)),
    )
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    window = block.config.sliding_window if block.sliding else None
    att = _cached_attention(
        q,
        k,
        v,
        packed,
        caches,
        layer,
        attn.scaling,
        groups=attn.num_key_value_groups,
        window=window,
        softmax_f32=True,
    )
    out = attn.o_proj(att)
    hidden = x + out
    return hidden + decoder.mlp(decoder.post_attention_layernorm(hidden))


def _gpt2_layer(
    block: GPT2Layer, x: torch.Tensor, packed: Packed, caches: list[SeqCache], layer: int
) -> torch.Tensor:
    decoder = block.layer
    attn = decoder.attn
    n, hd = x.shape[0], attn.head_dim
    h = decoder.ln_1(x)
    q, k, v = attn.c_attn(h).split(attn.split_size, dim=-1)
    q, k, v = (t.view(1, n, -1, hd).transpose(1, 2) for t in (q, k, v))
    att = _cached_attention(q, k, v, packed, caches, layer, attn.scaling)
    hidden = x + attn.c_proj(att)
    return hidden + decoder.mlp(decoder.ln_2(hidden))


def _cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: Packed,
    caches: list[SeqCache],
    layer: int,
    scaling: float,
    *,
    groups: int = 1,
    window: int | None = None,
    softmax_f32: bool = False,
) -> torch.Tensor:
    """Each packed sequence's new keys and values `k`, `v` (`[1, kv_heads, tokens, head_dim]`)
    written into its cache at `layer`, and its new queries `q` attended over all of its keys
    (`_attend`; each kv head shared by `groups` query heads). Returns `[tokens, heads x
    head_dim]` in packed order."""
    if groups > 1:
        from transformers.models.llama.modeling_llama import repeat_kv
    outs = []
    for o, start, count, cache in zip(
        packed.offsets(), packed.starts, packed.counts, caches, strict=True
    ):
        _write(cache, layer, start, k[0, :, o : o + count], v[0, :, o : o + count])
        keys, values = _read(cache, layer, start + count)
        if groups > 1:
            keys, values = repeat_kv(keys, groups), repeat_kv(values, groups)
        att = _attend(
            q[:, :, o : o + count], keys, values, start, scaling, window=window,
            softmax_f32=softmax_f32,
        )  # fmt: skip
        outs.append(att.reshape(count, -1))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _write(cache: SeqCache, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Keys and values `[kv_heads, count, head_dim]` of positions start.. into the blocks."""
    pos, done, count = start, 0, k.shape[1]
    while done < count:
        b, at = divmod(pos, KV_BLOCK)
        take = min(KV_BLOCK - at, count - done)
        block = cache.blocks[b]
        block[layer, 0, :, at : at + take].copy_(k[:, done : done + take])
        block[layer, 1, :, at : at + take].copy_(v[:, done : done + take])
        pos, done = pos + take, done + take


def _read(cache: SeqCache, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[1, kv_heads, length, head_dim]` of positions 0..length-1."""
    used = cache.blocks[: -(-length // KV_BLOCK)]
    if len(used) == 1:
        kv = used[0][layer, :, :, :length]
    else:
        kv = torch.cat([b[layer] for b in used], dim=2)[:, :, :length]
    return kv[0].unsqueeze(0), kv[1].unsqueeze(0)


def _opt_layer(
    block: OPTLayer, x: torch.Tensor, packed: Packed, caches: list[SeqCache], layer: int
) -> torch.Tensor:
    decoder = block.layer
    attn = decoder.self_attn
    before = decoder.do_layer_norm_before  # most OPTs; 350m normalises after
    n, hd = x.shape[0], attn.head_dim
    h = decoder.self_attn_layer_norm(x) if before else x
    # The queries scaled before the product, as OPT's attention does.
    q = (attn.q_proj(h) * attn.scaling).view(1, n, -1, hd).transpose(1, 2)
    k = attn.k_proj(h).view(1, n, -1, hd).transpose(1, 2)
    v = attn.v_proj(h).view(1, n, -1, hd).transpose(1, 2)
    att = _cached_attention(q, k, v, packed, caches, layer, 1.0, softmax_f32=True)
    hidden = x + attn.out_proj(att)
    if not before:
        hidden = decoder.self_attn_layer_norm(hidden)
    h = decoder.final_layer_norm(hidden) if before else hidden
    hidden = hidden + decoder.fc2(decoder.activation_fn(decoder.fc1(h)))
    return hidden if before else decoder.final_layer_norm(hidden)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    scaling: float,
    *,
    window: int | None = None,
    softmax_f32: bool = False,
) -> torch.Tensor:
    """Eager attention of one sequence's new queries `[1, heads, count, head_dim]` over its
    keys (as many heads): the math of transformers' `eager_attention_forward`, mask offset by
    `start`; `softmax_f32`: the softmax in float32 (the Llama family's), else in the scores'
    dtype (GPT-2's). Returns `[1, count, heads, head_dim]`."""
    scores = torch.matmul(q, keys.transpose(2, 3)) * scaling
    count, length = q.shape[2], keys.shape[2]
    if count > 1 or window is not None:
        qpos = torch.arange(start, start + count, device=q.device).unsqueeze(1)
        kpos = torch.arange(length, device=q.device).unsqueeze(0)
        allowed = kpos <= qpos
        if window is not None:
            allowed = allowed & (kpos > qpos - window)
        # The value the model's own masks add (its dtype's lowest), not -inf: the same scores.
        mask = torch.zeros(allowed.shape, dtype=scores.dtype, device=q.device)
        scores = scores + mask.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if softmax_f32:
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        weights = nn.functional.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(weights, values).transpose(1, 2)
