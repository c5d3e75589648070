"""What the broker reads of a language model's Hugging Face directory, and where it reads it.

Generation needs a few facts the model's files hold: its architecture (is it a language model
the workers can generate with), its longest sequence (`max_position_embeddings`), its
vocabulary size (prompt ids are checked at the door), the ids that end a sequence, and the
tokenizer a client asks for (`TokenizerInfo`). `read_lm_files` reads them, blocking, from
config.json and through `flowmesh.modelio.tokenizer.read_tokenizer` (no torch, no code from the
directory). It is never called on the event loop: the broker's rooms ask for a read
(`GenerationRoom.drain_reads`), and the shell runs it on a thread (`start_reads`) and hands the
result back on the loop (`BrokerCore.files_read`).

The broker reads a directory only after a partitioner planned the model from it, so only a path
under a partitioner's data roots, given by an operator (deploy needs the operator role).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from flowmesh.errors import Code, FlowmeshError

log = logging.getLogger("broker.lm_files")

# The architectures the workers generate with (`flowmesh.modelio.decode`), by config.json's
# `architectures[0]`; kept here because the broker imports no torch.
GEN_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "GPT2LMHeadModel",
    "OPTForCausalLM",
)
# Those whose positions are a learned table (`max_positions` rows): no sequence may run past it,
# whatever the deploy's max_context says (rotary ones may, as their configs' limits are soft).
LEARNED_POSITIONS = ("GPT2LMHeadModel", "OPTForCausalLM")


@dataclass(frozen=True)
class LmFiles:
    """A model directory's facts for generation; `error` set: not a model generation takes
    (or its files could not be read), and why."""

    architecture: str = ""
    max_positions: int | None = None
    vocab_size: int | None = None
    eos_ids: tuple[int, ...] = ()
    bos_id: int | None = None
    tokenizer_json: str | None = None  # None: the directory has no tokenizer
    chat_template: str = ""
    # The bos and eos strings its chat template sees ("": those of the ids).
    bos_token: str = ""
    eos_token: str = ""
    error: FlowmeshError | None = None
    # What a client's codec is built from, hashed (`codec_digest`; "": no tokenizer): a client
    # sends it with prompts it encoded, so that a model deployed again under the same name with
    # another tokenizer refuses them rather than generate from ids that mean other words.
    digest: str = ""
    # Why the tokenizer could not be read (its directory still generates from token ids).
    tokenizer_error: str = field(default="", compare=False)


def not_generative(what: str) -> FlowmeshError:
    return FlowmeshError(
        Code.BAD_REQUEST,
        f"{what}; generation takes a model deployed from a Hugging Face directory (hf=...) of "
        f"one of {', '.join(GEN_ARCHITECTURES)}",
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _ids(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, list) else [value]
    return tuple(v for v in items if isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def read_lm_files(hf: str) -> LmFiles:
    """Read `hf`'s facts for generation (blocking: call it on a thread). Never raises: a failure
    is the result's `error`."""
    try:
        return _read(hf)
    except FlowmeshError as exc:
        return LmFiles(error=exc)
    except Exception as exc:  # a file that is not what it claims: refuse generation, clearly
        log.warning("reading %s for generation failed", hf, exc_info=True)
        return LmFiles(error=FlowmeshError(Code.BAD_REQUEST, f"{hf!r}: {type(exc).__name__}"))


def _read(hf: str) -> LmFiles:
    cfg_path = Path(hf) / "config.json"
    try:
        config = json.loads(cfg_path.read_bytes())
    except (OSError, ValueError):
        return LmFiles(error=not_generative(f"{hf!r} has no readable config.json"))
    if not isinstance(config, dict):
        return LmFiles(error=not_generative(f"{hf!r}: config.json is not a JSON object"))
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    if arch not in GEN_ARCHITECTURES:
        # Only names flowmesh knows are shown, never text from the file.
        return LmFiles(error=not_generative("its config.json names no architecture it supports"))
    files = LmFiles(
        architecture=arch,
        max_positions=_int(config.get("max_position_embeddings")),
        vocab_size=_int(config.get("vocab_size")),
        eos_ids=_ids(config.get("eos_token_id")),
        bos_id=next(iter(_ids(config.get("bos_token_id"))), None),
    )
    try:
        from flowmesh.modelio.tokenizer import read_lm_config

        # generation_config.json's eos and bos win over config.json's, as in Hugging Face's own
        # generate (a model may end on several ids there and on one in config.json), and the
        # position limit goes by each architecture's name for it (GPT-2's n_positions); the
        # tokenizer's read below brings the same, but a directory may have no tokenizer.json.
        lm = read_lm_config(hf)
        files = _with(
            files,
            eos_ids=tuple(lm.eos_ids) or files.eos_ids,
            bos_id=files.bos_id if lm.bos_id is None else lm.bos_id,
            max_positions=files.max_positions or _int(lm.max_position_embeddings),
        )
    except FlowmeshError as exc:  # a generation_config.json that is not JSON: config.json's
        log.info("%s: %s", hf, exc.reason)
    except Exception:
        log.warning("reading the generation config of %s failed", hf, exc_info=True)
    try:
        from flowmesh.modelio.tokenizer import read_tokenizer

        tok = read_tokenizer(hf)
    except FlowmeshError as exc:
        return _with(files, tokenizer_error=exc.reason)
    except Exception as exc:
        log.warning("reading the tokenizer of %s failed", hf, exc_info=True)
        return _with(files, tokenizer_error=f"{type(exc).__name__}: {exc}")
    eos = tuple(getattr(tok, "eos_ids", ()) or ()) or files.eos_ids
    bos = getattr(tok, "bos_id", None)
    files = _with(
        files,
        tokenizer_json=getattr(tok, "tokenizer_json", None),
        chat_template=getattr(tok, "chat_template", "") or "",
        bos_token=getattr(tok, "bos_token", "") or "",
        eos_token=getattr(tok, "eos_token", "") or "",
        eos_ids=eos,
        bos_id=files.bos_id if bos is None else bos,
        max_positions=files.max_positions or _int(getattr(tok, "max_position_embeddings", None)),
    )
    return _with(files, digest=codec_digest(files)) if files.tokenizer_json is not None else files


def codec_digest(files: LmFiles) -> str:
    """A hash of everything a client's `TextCodec` is built from (`TokenizerReply`'s fields)."""
    facts = [
        files.tokenizer_json,
        files.chat_template,
        list(files.eos_ids),
        files.bos_id,
        files.bos_token,
        files.eos_token,
    ]
    return hashlib.blake2b(json.dumps(facts).encode(), digest_size=16).hexdigest()


def _with(files: LmFiles, **changes: Any) -> LmFiles:
    return dataclasses.replace(files, **changes)


class Reads(Protocol):
    """What `start_reads` needs of the broker (`BrokerCore`)."""

    def drain_reads(self) -> list[tuple[str, str]]: ...

    def files_read(self, model: str, hf: str, files: LmFiles, now: float) -> None: ...


def start_reads(
    core: Reads,
    loop: asyncio.AbstractEventLoop,
    clock: Callable[[], float],
    then: Callable[[], None],
) -> None:
    """Start every read the broker asked for on the loop's default executor; each result is
    handed back on the loop (`files_read`), then `then()` (the shell's flush) runs."""
    for model, hf in core.drain_reads():
        fut = loop.run_in_executor(None, read_lm_files, hf)

        def done(f: asyncio.Future[LmFiles], model: str = model, hf: str = hf) -> None:
            files = f.result() if not f.cancelled() else LmFiles(error=not_generative("unread"))
            try:
                core.files_read(model, hf, files, clock())
            finally:
                then()

        fut.add_done_callback(done)
