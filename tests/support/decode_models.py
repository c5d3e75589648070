"""Tiny random Llama-family models for the worker's generation tests (no tokenizer: the worker
sees token ids only), Hugging Face's own greedy generation on them, and a greedy driver that
plays the broker's iterations (prefills joining decodes, sequences leaving) over any step
function."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowmesh.messages import Sampling, SeqStep
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec
from gpu_worker.device import CpuStandIn
from gpu_worker.executor import Executor
from gpu_worker.stage_loader import prepare_stage
from partitioner.stage_plans import make_stage_plan

VOCAB = 97
ARCHS = ("llama", "qwen2", "mistral", "gpt2", "opt")
WINDOW = 6  # a sliding window shorter than the prompts, so that it matters


def tiny_lm(arch: str, seed: int = 0, *, layers: int = 3, hidden: int = 32) -> nn.Module:
    """A random causal LM of `arch` (float32, eager attention, eval). Qwen2: one full layer,
    then sliding ones; Mistral: every layer sliding. `initializer_range` 0.2 (not 0.02): the two
    best logits of a step are rarely within float32 noise, so greedy tokens compare exactly."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    if arch == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        )
        assert cfg.layer_types[:2] == ["full_attention", "sliding_attention"]
        cls = tf.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=WINDOW)
        cls = tf.MistralForCausalLM
    elif arch == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=128,
            initializer_range=0.2,
            attn_implementation="eager",
            # Layer-wise scaling on: its factor is in the attention's `scaling`, taken as is.
            scale_attn_by_inverse_layer_idx=True,
        )
        cls = tf.GPT2LMHeadModel
    elif arch == "opt":
        cfg = tf.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            ffn_dim=2 * hidden,
            word_embed_proj_dim=hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=128,
            init_std=0.2,
            attn_implementation="eager",
        )
        cls = tf.OPTForCausalLM
    else:
        raise AssertionError(arch)
    torch.manual_seed(seed)
    return cls(cfg).eval()


def saved_spec(model: nn.Module, path: Path, name: str, **fields) -> ModelSpec:  # type: ignore[no-untyped-def]
    """`model` saved with save_pretrained at `path`, as a spec deploying that directory."""
    model.save_pretrained(path)
    return ModelSpec(name=name, hf=str(path), **fields)


def prompts(lengths: list[int], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model: nn.Module, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor]:
    """HF `generate(do_sample=False)` on `prompt` alone: its `new` tokens (no eos: the models
    have none) and each step's logits `[new, vocab]`."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits)


# One iteration: (steps, packed ids) -> (next token per step, logits per step or None).
Step = Callable[[list[SeqStep], torch.Tensor], tuple[list[int], torch.Tensor | None]]


def greedy_batched(
    step: Step, all_prompts: list[list[int]], joins: list[int], new: int
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy generation of `new` tokens per prompt, continuously batched as the broker does:
    prompt i joins at iteration `joins[i]` (its prefill packed with the others' decodes) and
    leaves once it has its tokens. Returns each prompt's tokens and (when `step` gives them)
    each step's logits."""
    out: list[list[int]] = [[] for _ in all_prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in all_prompts]
    greedy = Sampling(max_tokens=new)
    it = 0
    while any(len(o) < new for o in out):
        steps, ids = [], []
        for i, p in enumerate(all_prompts):
            if joins[i] > it or len(out[i]) >= new:
                continue
            if not out[i]:
                steps.append(SeqStep(seq=100 + i, start=0, count=len(p), sampling=greedy))
                ids.extend(p)
            else:
                start = len(p) + len(out[i]) - 1
                steps.append(
                    SeqStep(seq=100 + i, start=start, count=1, sampling=greedy, drawn=len(out[i]))
                )
                ids.append(out[i][-1])
        if steps:
            tokens, step_logits = step(steps, torch.tensor(ids, dtype=torch.int64))
            for k, s in enumerate(steps):
                i = s.seq - 100
                out[i].append(tokens[k])
                if step_logits is not None:
                    logits[i].append(step_logits[k])
        it += 1
    return out, logits


async def two_stage_executor(spec: ModelSpec, budget: int, **options: Any) -> Executor:
    """An executor over a CPU stand-in of `budget` bytes holding `spec` cut in two stages, both
    loaded (`options`: the Executor's)."""
    return await staged_executor(spec, budget, 2, **options)


async def staged_executor(spec: ModelSpec, budget: int, stages: int, **options: Any) -> Executor:
    """`two_stage_executor` with `stages` stages."""
    ex = Executor(CpuStandIn(budget), **options)
    plan = make_stage_plan(spec, stages=stages)
    for i in range(stages):
        blocks, host = prepare_stage(spec, plan, i, ex.device, DEFAULT_ALLOW)
        ex.add_stage((spec.name, i), blocks, host, spec.kv_share)
        await ex.load((spec.name, i))
    return ex
