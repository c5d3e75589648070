"""A language model's tokenizer read from its directory (`flowmesh.modelio.tokenizer`), against
transformers' own tokenizer of the same directory: encoding, decoding, chat prompts, and text
decoded as tokens stream in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.tokenizer import TextCodec, read_lm_config, read_tokenizer
from tests.support.lm import BOS_ID, CHAT_TEMPLATE, CORPUS, EOS_ID, tiny_lm_dir

TEXTS = [
    "Hello! How are you today?",
    "Café, naïve — 日本語 🙂 ✓ and words the corpus never had: zygomorphic.",
    "  leading spaces, trailing spaces  ",
    "",
    *CORPUS[:3],
]
CHAT = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": "Once upon a time?"},
]


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_lm_dir(tmp_path_factory.mktemp("lm"), layers=1)


@pytest.fixture(scope="module")
def hf_tok(lm: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(lm)


def test_the_files_a_directory_has_are_read(lm: Path) -> None:
    files = read_tokenizer(lm)
    assert files.eos_ids == [EOS_ID] and files.bos_id == BOS_ID
    assert (files.bos_token, files.eos_token) == ("<s>", "</s>")
    assert files.chat_template == CHAT_TEMPLATE
    assert files.max_position_embeddings == 64
    assert json.loads(files.tokenizer_json)["model"]["type"] == "BPE"


def test_a_template_in_its_own_file_and_eos_ids_as_a_list(tmp_path: Path) -> None:
    path = tiny_lm_dir(tmp_path, layers=1, template_file=True)
    gen = path / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "eos_token_id": [EOS_ID, 5]}))
    files = read_tokenizer(path)
    assert files.chat_template == CHAT_TEMPLATE and files.eos_ids == [EOS_ID, 5]


def test_encode_and_decode_are_the_models_own(lm: Path, hf_tok) -> None:
    codec = TextCodec.from_files(read_tokenizer(lm))
    for text in TEXTS:
        ids = codec.encode(text)
        assert ids == hf_tok(text).input_ids, text
        assert ids[0] == BOS_ID  # the post-processor's
        assert codec.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
        assert codec.decode([*ids, EOS_ID]) == codec.decode(ids)


def test_a_chat_prompt_is_the_models_own(lm: Path, hf_tok) -> None:
    codec = TextCodec.from_files(read_tokenizer(lm))
    expected = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert codec.render_chat(CHAT) == expected
    ids = hf_tok(expected, add_special_tokens=False).input_ids
    assert codec.encode_chat(CHAT) == ids
    assert ids.count(BOS_ID) == 1  # the template's bos only, not the post-processor's too


def test_a_chat_template_runs_in_a_sandbox(lm: Path) -> None:
    files = read_tokenizer(lm)
    for template, words in (
        ("{{ raise_exception('only user turns') }}", "only user turns"),
        ("{% set _ = messages.append(1) %}", "refused"),
        ("{{ messages.__class__.__init__.__globals__['os'] }}", "refused"),
    ):
        codec = TextCodec(files.tokenizer_json, chat_template=template)
        with pytest.raises(FlowmeshError, match=words) as err:
            codec.render_chat(CHAT)
        assert err.value.code is Code.BAD_REQUEST
    with pytest.raises(FlowmeshError, match="no chat template"):
        TextCodec(files.tokenizer_json).render_chat(CHAT)


def test_streamed_text_joins_to_the_whole_decode(lm: Path) -> None:
    codec = TextCodec.from_files(read_tokenizer(lm))
    for text in TEXTS:
        ids = [*codec.encode(text, special=False), EOS_ID]
        stream = codec.stream()
        pieces = [stream.push([i]) for i in ids]
        pieces.append(stream.finish())
        assert "".join(pieces) == codec.decode(ids), text
        # A character of several tokens comes out whole, once its last byte is in.
        assert not any("\ufffd" in piece for piece in pieces), pieces
    # In bigger steps too, and a sequence that stops inside a character ends as decode has it.
    ids = codec.encode("🙂🙂", special=False)
    stream = codec.stream()
    pieces = [stream.push(ids[:1]), stream.push(ids[1:-1]), stream.finish()]
    assert "".join(pieces) == codec.decode(ids[:-1]) and pieces[0] == ""


def test_a_directory_without_a_tokenizer_is_refused_clearly(tmp_path: Path, lm: Path) -> None:
    with pytest.raises(FlowmeshError, match=r"has no tokenizer\.json") as err:
        read_tokenizer(tmp_path)
    assert err.value.code is Code.BAD_REQUEST
    with pytest.raises(FlowmeshError, match="does not exist") as err:
        read_tokenizer(tmp_path / "nowhere")
    assert err.value.code is Code.BAD_REQUEST
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(FlowmeshError, match="does not load") as err:
        read_tokenizer(tmp_path)
    assert err.value.code is Code.BAD_REQUEST
    (tmp_path / "tokenizer.json").write_text((lm / "tokenizer.json").read_text())
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(FlowmeshError, match=r"config\.json is not a JSON object"):
        read_tokenizer(tmp_path)


def test_eos_and_the_position_limit_need_no_tokenizer(tmp_path: Path) -> None:
    # GPT-2's config names its limit n_positions; config.json's eos when no generation_config.
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 32, "eos_token_id": 7}))
    lm = read_lm_config(tmp_path)
    assert (lm.eos_ids, lm.bos_id, lm.max_position_embeddings) == ([7], None, 32)


def test_the_module_does_not_import_torch() -> None:
    # The broker reads tokenizers; the client codes text: neither needs torch for it.
    code = "import sys, flowmesh.modelio.tokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
