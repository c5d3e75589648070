"""Generation's forward (`flowmesh.modelio.decode`) and sampling (`flowmesh.modelio.sampling`)
against the models' own: packed prefills give the logits of the model's forward, and a greedy
loop through the KV cache, sequences of different lengths joining mid-way, gives the tokens and
logits of HF `generate(do_sample=False)` for each prompt alone; in one stage and in two (the
hidden states passed on, each stage its own cache). Tiny random Llama, Qwen2 (full then sliding
layers), Mistral (sliding), GPT-2 (learned positions, attention scaled by layer) and OPT
(learned positions with their offset) models, float32, eager attention."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.messages import Sampling, SeqStep
from flowmesh.modelio.chain import chain_of
from flowmesh.modelio.decode import KV_BLOCK, Packed, SeqCache, gen_forward, kv_shape
from flowmesh.modelio.sampling import at_draw, new_generator, sample
from flowmesh.testing import assert_forward_close
from tests.support.decode_models import (
    ARCHS,
    VOCAB,
    WINDOW,
    greedy_batched,
    hf_greedy,
    prompts,
    tiny_lm,
)
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)


class Stages:
    """A model's chain cut into stages, each with its own KV per sequence (as each stage's
    worker keeps its own), driven one iteration at a time."""

    def __init__(self, model: nn.Module, cuts: list[int]) -> None:
        blocks = [b.module for b in chain_of(model)]
        bounds = [0, *cuts, len(blocks)]
        self.stages = [blocks[a:b] for a, b in itertools.pairwise(bounds)]
        self.shapes = [kv_shape(s) for s in self.stages]
        self.caches: list[dict[int, SeqCache]] = [{} for _ in self.stages]

    def _cache(self, stage: int, seq: int, tokens: int) -> SeqCache:
        cache = self.caches[stage].setdefault(seq, SeqCache([]))
        while len(cache.blocks) * KV_BLOCK < tokens:  # grown as the worker's kv_cache does
            cache.blocks.append(torch.full(self.shapes[stage].block_shape, float("nan")))
        return cache

    def forward(self, steps: list[SeqStep], ids: torch.Tensor) -> torch.Tensor:
        packed = Packed([s.start for s in steps], [s.count for s in steps])
        x = ids
        with torch.no_grad():
            for k, blocks in enumerate(self.stages):
                caches = [self._cache(k, s.seq, s.start + s.count) for s in steps]
                x = gen_forward(blocks, x, packed, caches)
        return x

    def greedy(self, steps: list[SeqStep], ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        logits = self.forward(steps, ids)
        return logits.argmax(-1).tolist(), logits


CUTS = {1: [], 2: [2]}  # 2 stages: embed + first layer | the other layers + head


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_prefills_give_the_models_last_token_logits(arch: str, stages: int) -> None:
    model = tiny_lm(arch)
    chain = Stages(model, CUTS[stages])
    ps = prompts([5, 21, 1, 16])  # within a block, over one, one token, exactly one block
    steps = [SeqStep(seq=i, start=0, count=len(p), sampling=Sampling()) for i, p in enumerate(ps)]
    logits = chain.forward(steps, torch.tensor([t for p in ps for t in p]))
    assert logits.shape == (len(ps), VOCAB)
    for i, p in enumerate(ps):
        with torch.no_grad():
            expected = model(torch.tensor([p])).logits[0, -1]
        assert_forward_close(logits[i], expected, f"{arch}, prompt {i}")


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_through_the_kv_cache_equals_generate_with_sequences_joining_midway(
    arch: str,
) -> None:
    model = tiny_lm(arch)
    new = 8
    # Different lengths (one over a block, one shorter than the sliding window), packed
    # together; the third and fourth join while the others decode.
    ps = prompts([7, 19, 3, 2 * WINDOW + 1])
    tokens, logits = greedy_batched(Stages(model, CUTS[2]).greedy, ps, joins=[0, 0, 2, 5], new=new)
    for i, p in enumerate(ps):
        ids, expected = hf_greedy(model, p, new)
        assert tokens[i] == ids, f"{arch}, prompt {i}"
        assert_forward_close(torch.stack(logits[i]), expected, f"{arch}, prompt {i}")


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_prefilled_in_pieces_gives_the_logits_of_one_prefill(arch: str) -> None:
    # Several new tokens after cached ones: the causal mask is offset by what is cached.
    model = tiny_lm(arch)
    (p,) = prompts([23])
    chain = Stages(model, CUTS[2])
    first = SeqStep(seq=1, start=0, count=10, sampling=Sampling())
    chain.forward([first], torch.tensor(p[:10]))
    rest = SeqStep(seq=1, start=10, count=13, sampling=Sampling())
    logits = chain.forward([rest], torch.tensor(p[10:]))
    with torch.no_grad():
        expected = model(torch.tensor([p])).logits[0, -1]
    assert_forward_close(logits[0], expected, arch)


def test_a_block_generation_does_not_run_is_named() -> None:
    # A factory's own chain (not a language model the decode path knows).
    blocks: list[nn.Module] = [nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Linear(16, VOCAB)]
    with pytest.raises(FlowmeshError) as err:
        kv_shape(blocks)
    assert err.value.code == Code.BAD_REQUEST
    assert err.value.reason == (
        "generation supports Llama, Qwen2, Mistral, GPT-2 and OPT models (blocks DecoderEmbed, "
        "RopeLayer, NormHead, GPT2Embed, GPT2Layer, GPT2Head, OPTEmbed, OPTLayer, OPTHead); "
        "this stage has: Embedding, Linear"
    )


def test_a_stage_keeps_the_kv_of_its_own_layers_only() -> None:
    shapes = Stages(tiny_lm("llama", layers=3), [2]).shapes
    assert [(s.layers, s.kv_heads, s.head_dim) for s in shapes] == [(1, 2, 8), (2, 2, 8)]
    # 16 tokens x K and V x 2 heads x 8 floats x layers
    assert [s.block_bytes for s in shapes] == [16 * 2 * 2 * 8 * 4, 2 * 16 * 2 * 2 * 8 * 4]


# ------------------------------------------------------------------ sampling


def _logits(rows: int = 6, seed: int = 5) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_top_k_one_and_a_tiny_top_p_draw_the_greedy_token() -> None:
    logits = _logits()
    greedy = logits.argmax(-1)
    for s in (
        Sampling(temperature=1.5, top_k=1, seed=1),
        Sampling(temperature=1.5, top_p=1e-6, seed=1),
        Sampling(temperature=0.0),
    ):
        gens = [new_generator(s, logits.device) for _ in range(len(logits))]
        assert sample(logits, [s] * len(logits), gens).tolist() == greedy.tolist(), s


def test_a_seeded_sequence_draws_the_same_tokens_whatever_the_batch() -> None:
    logits = _logits(rows=3)
    s = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=42)
    other = Sampling(temperature=2.0, seed=7)
    alone_gen = new_generator(s, logits.device)
    batched = [new_generator(other, logits.device), new_generator(s, logits.device)]
    alone, together = [], []
    for _ in range(20):  # the generator is kept from one iteration to the next
        alone.append(int(sample(logits[:1], [s], [alone_gen])[0]))
        rows = torch.stack([logits[2], logits[0]])
        together.append(int(sample(rows, [other, s], batched)[1]))
    assert alone == together
    assert len(set(alone)) > 1  # drawn, not greedy
    # top_k: never outside the k most likely
    top = set(torch.topk(logits[0], 20).indices.tolist())
    assert set(alone) <= top


def test_a_seeded_draw_depends_on_its_position_only_so_a_resumed_sequence_draws_the_same() -> None:
    logits = _logits(rows=1)
    s = Sampling(temperature=1.0, top_k=40, seed=42)

    def draws(start: int, stop: int) -> list[int]:
        gen = new_generator(s, logits.device)  # a fresh generator, as after a preemption
        base = gen.initial_seed()
        return [int(sample(logits, [s], [at_draw(gen, base, k)])[0]) for k in range(start, stop)]

    whole = draws(0, 30)
    assert draws(12, 30) == whole[12:]
    assert len(set(whole)) > 3  # draws, not one token again and again
    other = Sampling(temperature=1.0, top_k=40, seed=43)
    gen = new_generator(other, logits.device)
    base = gen.initial_seed()
    assert [int(sample(logits, [other], [at_draw(gen, base, k)])[0]) for k in range(30)] != whole


def test_top_p_keeps_the_smallest_prefix_reaching_it() -> None:
    # probabilities 0.5, 0.3, 0.2 (and ~0): top_p 0.75 keeps the first two, 0.8 keeps them too
    # (their sum reaches it), 0.81 keeps three.
    probs = torch.tensor([0.5, 0.3, 0.2] + [1e-12] * (VOCAB - 3))
    logits = probs.log().unsqueeze(0)
    for top_p, allowed in ((0.75, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2})):
        s = Sampling(temperature=1.0, top_p=top_p, seed=3)
        gen = new_generator(s, logits.device)
        drawn = {int(sample(logits, [s], [gen])[0]) for _ in range(200)}
        assert drawn == allowed, (top_p, drawn)
