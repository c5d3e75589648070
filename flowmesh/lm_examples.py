"""Tiny random causal language models saved as Hugging Face directories (weights with
`save_pretrained`, a real byte-level BPE `tokenizer.json`, a chat template, a generation config),
and Hugging Face's own greedy generation on them: what the demo generates with and checks its
tokens against, and what the generation tests deploy. Their weights are random: the text they
write means nothing, but every token of it can be compared with the model's own `generate`.

Needs `transformers` (the test extra, which `bash dev.sh` installs), imported only when called."""

from __future__ import annotations

from pathlib import Path

import torch

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# Special tokens first, so that their ids are fixed whatever the corpus learns.
SPECIALS = [PAD, BOS, EOS]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# A fixed little corpus: English, numbers, and characters that take several bytes in UTF-8
# (a byte-level tokenizer cuts them into several tokens, which a stream must not print halfway).
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token from the tokens before it.",
    "Pipeline stages pass hidden states from one worker to the next.",
    "Keys and values are kept in blocks of sixteen tokens.",
    "Once upon a time there was a tiny model that told short stories.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024.",
    "Café, naïve, déjà vu; 日本語のテキスト; emoji 🙂 and ✓.",
    "Hello! How are you today? I am fine, thank you.",
]

# A chat template in the style of the models' own (Zephyr-like): bos, then each message.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# arch -> transformers class name prefix (<Prefix>Config, <Prefix>ForCausalLM); and "gpt2", "opt"
ARCHS = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}


def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained on CORPUS, adding bos in front of every encoded text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIALS] == [PAD_ID, BOS_ID, EOS_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def tiny_lm_dir(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 32,
    max_positions: int = 64,
    template_file: bool = False,
    init_range: float = 0.2,
) -> Path:
    """Write a tiny random causal LM of `arch` ("llama", "qwen2", "mistral", "gpt2", "opt") to
    `path` and return it. Its vocabulary is the tokenizer's; eos is `EOS_ID`. `template_file`:
    the chat template in `chat_template.jinja` rather than in tokenizer_config.json.
    `init_range` larger than the models' default 0.02 so that the best two logits of a step are
    rarely within float32 noise of each other (greedy tokens then compare exactly)."""
    import transformers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tok = build_tokenizer()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    _place_template(path, in_file=template_file)

    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    if arch == "gpt2":  # its own names for the sizes; tied embeddings, as GPT-2 has them
        config = transformers.GPT2Config(
            vocab_size=tok.get_vocab_size(),
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=max_positions,
            initializer_range=init_range,
            **ids,
        )
        cls = transformers.GPT2LMHeadModel
    elif arch == "opt":
        config = transformers.OPTConfig(
            vocab_size=tok.get_vocab_size(),
            hidden_size=hidden,
            ffn_dim=2 * hidden,
            word_embed_proj_dim=hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=max_positions,
            init_std=init_range,
            **ids,
        )
        cls = transformers.OPTForCausalLM
    else:
        config = getattr(transformers, f"{ARCHS[arch]}Config")(
            vocab_size=tok.get_vocab_size(),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False,
            initializer_range=init_range,
            **ids,
        )
        cls = getattr(transformers, f"{ARCHS[arch]}ForCausalLM")
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(path)  # safetensors and generation_config.json
    return path


def _place_template(path: Path, *, in_file: bool) -> None:
    """Put the chat template where asked, whichever place this transformers version wrote it."""
    import json

    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    jinja = path / "chat_template.jinja"
    if in_file:
        config.pop("chat_template", None)
        jinja.write_text(CHAT_TEMPLATE)
    else:
        config["chat_template"] = CHAT_TEMPLATE
        jinja.unlink(missing_ok=True)
    config_path.write_text(json.dumps(config, indent=2))


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _generate(path: Path, prompts_ids: list[list[int]], max_new_tokens: int, ignore_eos: bool):
    from transformers import GenerationConfig

    model = _load(path)
    if ignore_eos:
        # An eos of None in the call's config is filled in from the model's own: clear that.
        model.generation_config.eos_token_id = None
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None if ignore_eos else model.generation_config.eos_token_id,
        pad_token_id=PAD_ID,
        output_logits=True,
        return_dict_in_generate=True,
    )
    outs = []
    for ids in prompts_ids:  # one at a time: no padding, which would change the numbers
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                generation_config=config,
            )
        new = out.sequences[0, len(ids) :].tolist()
        outs.append((new, torch.cat(out.logits)[: len(new)]))
    return outs


def hf_generate(
    path: Path, prompts_ids: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = False
) -> list[list[int]]:
    """Hugging Face's own greedy new tokens for each prompt (float32, eager attention, each prompt
    alone), ending at eos (kept) or after `max_new_tokens`."""
    return [ids for ids, _ in _generate(path, prompts_ids, max_new_tokens, ignore_eos)]


def hf_generate_logits(
    path: Path, prompts_ids: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = False
) -> list[tuple[list[int], torch.Tensor]]:
    """As hf_generate, with each step's logits ([new tokens, vocab], float32)."""
    return _generate(path, prompts_ids, max_new_tokens, ignore_eos)
