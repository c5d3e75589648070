"""The exactness table's preemption column, shared by the real-process test
(tests/mesh/test_generation.py) and the in-process one (tests/scenarios/
test_generation_preemption.py): three prompts that fit one KV block each and grow into a
second as they decode, on a deployment whose KV share holds three blocks per worker, so that
the newest sequence is preempted when one crosses into its second block."""

from __future__ import annotations

import functools
from pathlib import Path

from flowmesh.modelio.decode import KV_BLOCK
from flowmesh.modelio.tokenizer import TextCodec, read_tokenizer
from tests.support.lm import hf_generate, tiny_lm_dir

# tiny_lm_dir's shapes: 4 layers, hidden 32 over 4 heads (head size 8); GPT-2 and OPT have no
# grouped KV heads (4), the others 2. A 2-stage plan cuts the layers 2 and 2 (embed and head
# beside).
LM_LAYERS, HEAD_DIM = 4, 8
KV_HEADS = {"llama": 2, "qwen2": 2, "mistral": 2, "gpt2": 4, "opt": 4}
# 15, 13 and 12 tokens (bos included): one block each, two a few new tokens later.
PREEMPTED = ["Once upon a time", "Hello! How are you today", "Numbers: 1 2 3 4"]
PREEMPTED_NEW = 8


def kv_block_bytes(arch: str, stages: int) -> int:
    """One KV block on each stage's worker: keys and values of its layers for KV_BLOCK tokens,
    float32 (what the worker's cap counts, `flowmesh.modelio.decode.KVShape.block_bytes`)."""
    return (LM_LAYERS // stages) * 2 * KV_HEADS[arch] * KV_BLOCK * HEAD_DIM * 4


def three_blocks_share(arch: str, stages: int, budget: int) -> float:
    """The kv_share of `budget` that holds three blocks and a byte: what int(share * budget)
    rounds to stays within [3, 4) blocks."""
    return (3 * kv_block_bytes(arch, stages) + 1) / budget


@functools.cache
def preempted_reference(parent: Path, arch: str) -> tuple[Path, list[list[int]]]:
    """`arch`'s tiny model under `parent` and HF's greedy tokens for PREEMPTED: made once for
    both stage counts (the model and its tokens do not depend on the plan)."""
    model_dir = tiny_lm_dir(parent / f"tiny-{arch}-preempted", arch, seed=6, max_positions=48)
    codec = TextCodec.from_files(read_tokenizer(model_dir))
    prompts_ids = [codec.encode(t) for t in PREEMPTED]
    # Each prompt within one block, each whole sequence past it (within two, and the context).
    assert all(len(i) < KV_BLOCK < len(i) + PREEMPTED_NEW <= 2 * KV_BLOCK for i in prompts_ids)
    return model_dir, hf_generate(model_dir, prompts_ids, PREEMPTED_NEW, ignore_eos=True)
