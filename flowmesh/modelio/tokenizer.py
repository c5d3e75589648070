"""A language model's tokenizer, read from its Hugging Face directory without running its code,
and the text side of generation built on it (no torch here: the broker reads, the client codes).

`read_tokenizer(dir)` (the broker, on a thread) gathers what `TokenizerReply` carries:
`tokenizer.json` as text (the `tokenizers` library's format, checked to load), the chat template
(`tokenizer_config.json` "chat_template", or `chat_template.jinja` as newer `save_pretrained`
writes it), the ids that end a sequence (generation_config.json, else config.json
"eos_token_id"), bos, and the model's position limit.

`TextCodec` (the client) encodes prompts as the model's own tokenizer does (its special tokens
and post-processor: bos where the model wants it), renders chat prompts with the template in
jinja2's immutable sandbox with what transformers passes it (messages, add_generation_prompt,
bos_token, eos_token), and decodes tokens as they stream (`StreamDecoder`): only text that is
complete, never half a character.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from flowmesh.errors import Code, FlowmeshError, bad_request
from flowmesh.roots import io_error

if TYPE_CHECKING:
    from flowmesh.messages import TokenizerReply

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"
CONFIG = "config.json"
# config.json keys that name the longest sequence, by architecture family (GPT-2: n_positions).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
# What a decode that stopped inside a multi-byte character ends with.
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TokenizerFiles:
    """What a model directory says about its text: see the module's docstring. `bos_token` and
    `eos_token` are the strings a chat template sees ("" when the directory names none)."""

    tokenizer_json: str
    chat_template: str = ""
    eos_ids: list[int] = field(default_factory=list)
    bos_id: int | None = None
    bos_token: str = ""
    eos_token: str = ""
    max_position_embeddings: int | None = None


@dataclass(frozen=True)
class LmConfig:
    """What generation needs of a model directory besides its tokenizer: the ids that end a
    sequence, bos, and the model's position limit (None: its config names none)."""

    eos_ids: list[int] = field(default_factory=list)
    bos_id: int | None = None
    max_position_embeddings: int | None = None


def read_lm_config(path: str | Path) -> LmConfig:
    """Hugging Face directory `path`'s eos and bos ids (generation_config.json, else
    config.json) and position limit (config.json), tokenizer or not: generation from token ids
    needs no tokenizer. Blocking (file reads): call it off the event loop."""
    root, where = _directory(path)
    gen_config = _read_json(root / GENERATION_CONFIG, where)
    config = _read_json(root / CONFIG, where)
    bos = _ids(gen_config.get("bos_token_id")) or _ids(config.get("bos_token_id"))
    positions = next(
        (config[k] for k in POSITION_KEYS if isinstance(config.get(k), int) and config[k] > 0),
        None,
    )
    return LmConfig(
        eos_ids=_ids(gen_config.get("eos_token_id")) or _ids(config.get("eos_token_id")),
        bos_id=bos[0] if bos else None,
        max_position_embeddings=positions,
    )


def read_tokenizer(path: str | Path) -> TokenizerFiles:
    """The tokenizer files of Hugging Face directory `path` (with `read_lm_config`'s figures).
    BAD_REQUEST when it has no tokenizer.json (or one that does not load), IO_ERROR when a file
    cannot be read. Blocking (file reads, a tokenizer load): call it off the event loop."""
    root, where = _directory(path)
    if not (root / TOKENIZER).is_file():
        raise bad_request(
            f"{where} has no {TOKENIZER}: text needs the model's tokenizer (generation from "
            f"token ids works without one)"
        )
    text = _read_text(root / TOKENIZER, where)
    try:
        tok = Tokenizer.from_str(text)
    except Exception:  # the library's words may quote the file: say what, not what is there
        raise bad_request(f"{where}: {TOKENIZER} does not load as a tokenizers file") from None
    lm = read_lm_config(root)
    tok_config = _read_json(root / TOKENIZER_CONFIG, where)
    bos_token = _token_text(tok_config.get("bos_token"))
    eos_token = _token_text(tok_config.get("eos_token"))
    eos_ids = lm.eos_ids
    if not eos_ids and eos_token and tok.token_to_id(eos_token) is not None:
        eos_ids = [tok.token_to_id(eos_token)]
    # The bos a template writes is the tokenizer's; the config's when it names none.
    bos_id = tok.token_to_id(bos_token) if bos_token else None
    return TokenizerFiles(
        tokenizer_json=text,
        chat_template=_chat_template(root, tok_config, where),
        eos_ids=eos_ids,
        bos_id=lm.bos_id if bos_id is None else bos_id,
        bos_token=bos_token,
        eos_token=eos_token,
        max_position_embeddings=lm.max_position_embeddings,
    )


def _directory(path: str | Path) -> tuple[Path, str]:
    root = Path(path)
    if not root.is_dir():
        raise bad_request(f"hf directory {str(path)!r} does not exist or is not a directory")
    return root, f"hf directory {str(path)!r}"


def _read_text(file: Path, where: str) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except OSError as exc:
        raise io_error(exc, f"{where}: {file.name}") from None
    except UnicodeDecodeError:
        raise bad_request(f"{where}: {file.name} is not UTF-8 text") from None


def _read_json(file: Path, where: str) -> dict[str, Any]:
    """A JSON object file of the directory; {} when it is not there (each is optional)."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(_read_text(file, where))
    except ValueError:
        raise bad_request(f"{where}: {file.name} is not JSON") from None
    if not isinstance(data, dict):
        raise bad_request(f"{where}: {file.name} is not a JSON object")
    return data


def _chat_template(root: Path, tok_config: dict[str, Any], where: str) -> str:
    """The template as transformers picks it: tokenizer_config.json's (a string, or a list of
    named ones of which "default"), else chat_template.jinja; "" when there is none."""
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    if (root / TEMPLATE_FILE).is_file():
        return _read_text(root / TEMPLATE_FILE, where)
    return ""


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _ids(value: Any) -> list[int]:
    """A config's token id field: an int, a list of ints, or missing."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


# -- the client's side


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's part for
    training masks) renders its body, as transformers does when it is not tracking."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: jinja's own escapes HTML characters, which a prompt must not get.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in, with the same helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class TextCodec:
    """Text to a model's token ids and back (see the module's docstring). Built from what
    `read_tokenizer` read (`from_files`), or from a `TokenizerReply` (`from_reply`). Blocking:
    an async caller runs its calls on a thread."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        chat_template: str = "",
        eos_ids: list[int] | None = None,
        bos_id: int | None = None,
        bos_token: str = "",
        eos_token: str = "",
        digest: str = "",
    ) -> None:
        try:
            self.tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception:
            raise FlowmeshError(Code.BAD_REQUEST, "the model's tokenizer does not load") from None
        self.chat_template = chat_template
        self.eos_ids = list(eos_ids or [])
        self.bos_id = bos_id
        # The strings a template sees: the directory's, else those of the ids.
        self.bos_token = bos_token or self._token(bos_id)
        self.eos_token = eos_token or self._token(self.eos_ids[0] if self.eos_ids else None)
        self._template: jinja2.Template | None = None
        self.digest = digest  # the broker's name for what this was built from ("": unknown)

    @classmethod
    def from_files(cls, files: TokenizerFiles) -> TextCodec:
        return cls(
            files.tokenizer_json,
            chat_template=files.chat_template,
            eos_ids=files.eos_ids,
            bos_id=files.bos_id,
            bos_token=files.bos_token,
            eos_token=files.eos_token,
        )

    @classmethod
    def from_reply(cls, reply: TokenizerReply) -> TextCodec:
        """From a `TokenizerReply`."""
        return cls(
            reply.tokenizer_json,
            chat_template=reply.chat_template,
            eos_ids=list(reply.eos_ids),
            bos_id=reply.bos_id,
            bos_token=reply.bos_token,
            eos_token=reply.eos_token,
            digest=reply.digest,
        )

    def _token(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.id_to_token(token_id) or ""

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """`text`'s ids; `special`: with the tokenizer's own additions (bos, ...)."""
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        """The text of generated `ids`, special tokens (eos) left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The prompt of a chat (`[{"role": ..., "content": ...}, ...]`) as the model's template
        writes it, ready for the assistant's answer (add_generation_prompt)."""
        if not self.chat_template:
            raise bad_request("the model has no chat template: give a prompt, not messages")
        try:
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:  # raise_exception's words are the template's own
            raise bad_request(f"the model's chat template refused the messages: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """A chat's prompt ids. The template writes the special tokens itself, so none are
        added (as transformers' `apply_chat_template` encodes)."""
        return self.encode(self.render_chat(messages), special=False)

    def stream(self) -> StreamDecoder:
        """A decoder for one sequence's tokens as they come."""
        return StreamDecoder(self)


class StreamDecoder:
    """One sequence's text as its tokens stream in: `push` gives the new complete text (decoded
    over a few tokens before the new ones, so that a tokenizer that writes a token's leading
    space depending on what precedes it still joins up), holding back a trailing half
    character; `finish` gives what was held back. The pieces join to `decode(ids)`."""

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self._prefix = 0  # the window decoded for context starts here
        self._read = 0  # the text of ids before this is given out

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self.codec.decode(self.ids[self._prefix : self._read])
        now = self.codec.decode(self.ids[self._prefix :])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete: wait for its bytes
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :]

    def finish(self) -> str:
        """The text still held back (an incomplete character at the very end, as decode has
        it)."""
        before = self.codec.decode(self.ids[self._prefix : self._read])
        now = self.codec.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return now[len(before) :]
