"""The tiny language models of the generation tests: `flowmesh.lm_examples` (the demo's too)."""

from flowmesh.lm_examples import (
    BOS,
    BOS_ID,
    CHAT_TEMPLATE,
    CORPUS,
    EOS,
    EOS_ID,
    PAD,
    PAD_ID,
    build_tokenizer,
    hf_generate,
    hf_generate_logits,
    tiny_lm_dir,
)

__all__ = [
    "BOS",
    "BOS_ID",
    "CHAT_TEMPLATE",
    "CORPUS",
    "EOS",
    "EOS_ID",
    "PAD",
    "PAD_ID",
    "build_tokenizer",
    "hf_generate",
    "hf_generate_logits",
    "tiny_lm_dir",
]
