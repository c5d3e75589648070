"""Picking each sequence's next token from its logits (the last stage of a generation).

Temperature 0 takes the most likely token (greedy, all such sequences in one argmax), and so does
any temperature below GREEDY_BELOW: that is what the draw tends to as the temperature falls, and
dividing by such a temperature overflows (1e-40 is a valid `Sampling`; a sequence's sampling must
never fail the iteration it shares with others). Otherwise the logits, shifted by their maximum
(the largest becomes 0, the others negative: with finite logits no temperature can overflow
them to +inf or make NaN), are divided by the temperature, cut to the `top_k` most likely (0: no
cut), then to the smallest set of most likely tokens whose probability reaches `top_p` (always at
least one), and one token is drawn from what is left with the sequence's own `torch.Generator`:
seeded with `Sampling.seed`, or once from `os.urandom` when it has none. Before each draw the
worker seeds it again from that seed and the number of tokens the sequence has drawn
(`at_draw`), so that a sequence's k-th token depends on its seed, its logits and k only: the
same whatever else is in the batch, and the same after a preemption, when the sequence resumes
on a fresh generator.
"""

from __future__ import annotations

import os

import torch

from flowmesh.messages import Sampling

# Temperatures below this draw the most likely token (vLLM's `_SAMPLING_EPS` is the same).
GREEDY_BELOW = 1e-5


def new_generator(sampling: Sampling, device: torch.device) -> torch.Generator:
    """A sequence's generator, on the logits' device."""
    seed = sampling.seed
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    return torch.Generator(device=device).manual_seed(seed)


def at_draw(generator: torch.Generator, base: int, drawn: int) -> torch.Generator:
    """`generator` seeded for a sequence's draw number `drawn` from its seed `base` (a
    splitmix64 step of the two, so that nearby seeds and positions give unrelated streams)."""
    z = (base + (drawn + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return generator.manual_seed((z ^ (z >> 31)) & ((1 << 63) - 1))


def sample(
    logits: torch.Tensor,
    samplings: list[Sampling],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One token per row of `logits` `[sequences, vocab]` (int64 `[sequences]`), row i by
    `samplings[i]`, drawn with `generators[i]` (None only for a greedy row)."""
    out = torch.argmax(logits, dim=-1)
    for i, s in enumerate(samplings):
        if s.temperature < GREEDY_BELOW:
            continue
        generator = generators[i]
        assert generator is not None, "a sampled sequence needs its generator"
        out[i] = draw(logits[i], s, generator)
    return out


def draw(logits: torch.Tensor, s: Sampling, generator: torch.Generator) -> torch.Tensor:
    """One token from one row of logits `[vocab]` (see the module docstring)."""
    row = logits.float()
    scaled = (row - row.max()) / s.temperature
    k = s.top_k if 0 < s.top_k < scaled.shape[-1] else scaled.shape[-1]
    top, ids = torch.topk(scaled, k)  # sorted, most likely first
    probs = torch.softmax(top, dim=-1)
    if s.top_p < 1.0:
        # Keep the prefix whose sum reaches top_p: a token stays if what comes before it is
        # still short of top_p (the first one always does).
        before = torch.cumsum(probs, dim=-1) - probs
        probs = probs.masked_fill(before >= s.top_p, 0.0)
    pick = torch.multinomial(probs, 1, generator=generator)
    return ids[pick[0]]
