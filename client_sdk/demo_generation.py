"""The demo's generation part: a language model from a Hugging Face directory, cut into two
pipeline stages, generating for concurrent clients beside the catalogue it shares the workers
with.

The model is a tiny random Llama written by `flowmesh.lm_examples` (weights with
`save_pretrained`, a byte-level BPE tokenizer, a chat template): its text means nothing, but
every token of it is checked against Hugging Face's own greedy `generate` on the same
directory once the mesh has answered. Its calls run at once — a batch of prompts in one call,
single prompts from other calls, a chat and a stream — so the broker batches their sequences
continuously (each joins the running batch between iterations). Needs `transformers` (the test
extra that `bash dev.sh` installs); without it the part is skipped, saying why.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path

from client_sdk.client import AsyncClient
from client_sdk.generation import Generation
from client_sdk.views import table
from flowmesh.reports import ModelRow

LM_NAME = "tiny-llama"
LM_TOKENS = 24
BATCH = ["The quick brown fox", "Pipeline stages pass", "Numbers: 1 2 3"]
SINGLE = ["Once upon a time", "Keys and values are kept", "Hello! How are you"]
STREAMED = "A language model predicts"
CHAT = [{"role": "user", "content": "Tell me a short story."}]


@dataclass
class Generated:
    """What the part got: each sequence's prompt (as shown) and result, in one order."""

    row: ModelRow | None = None
    prompts: list[str] = field(default_factory=list)
    outputs: list[Generation] = field(default_factory=list)
    stream_chunks: int = 0
    seconds: float = 0.0
    error: str = ""


def available() -> str:
    """Why the part cannot run here ("" when it can)."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install -e '.[test]', or bash dev.sh demo)"
    return ""


def prepare(root: Path, seed: int = 0) -> Path:
    """Write the tiny Llama's directory under `root` (a directory the mesh reads from)."""
    from flowmesh.lm_examples import tiny_lm_dir

    return tiny_lm_dir(root / LM_NAME, "llama", seed=seed, max_positions=128)


async def run(address: str, model_dir: Path) -> Generated:
    """Deploy the model in two stages and generate for concurrent calls."""
    out = Generated()
    async with AsyncClient(address, timeout=120) as c:
        out.row = await c.deploy(LM_NAME, hf=str(model_dir), stages=2, max_seqs=8)
        t0 = time.perf_counter()

        async def streamed() -> Generation:
            async with c.generate_stream(LM_NAME, STREAMED, max_tokens=LM_TOKENS) as stream:
                async for _ in stream:
                    out.stream_chunks += 1
            assert stream.generations is not None
            return stream.generations[0]

        batch, *rest = await asyncio.gather(
            c.generate(LM_NAME, BATCH, max_tokens=LM_TOKENS),
            *(c.generate(LM_NAME, t, max_tokens=LM_TOKENS) for t in SINGLE),
            c.generate(LM_NAME, messages=CHAT, max_tokens=LM_TOKENS),
            streamed(),
        )
        out.seconds = time.perf_counter() - t0
        assert isinstance(batch, list)
        out.prompts = [*BATCH, *SINGLE, f"(chat) {CHAT[0]['content']}", f"(stream) {STREAMED}"]
        out.outputs = [*batch, *rest]  # type: ignore[list-item]
        status = await c.status()
        out.row = next((m for m in status.models if m.name == LM_NAME), out.row)
    return out


def expected(model_dir: Path) -> list[list[int]]:
    """Hugging Face's own greedy tokens for the part's prompts, in `Generated.prompts` order."""
    from flowmesh.lm_examples import hf_generate
    from flowmesh.modelio.tokenizer import TextCodec, read_tokenizer

    codec = TextCodec.from_files(read_tokenizer(model_dir))
    ids = [codec.encode(t) for t in [*BATCH, *SINGLE]]
    ids += [codec.encode_chat(CHAT), codec.encode(STREAMED)]
    return hf_generate(model_dir, ids, LM_TOKENS)


def report(got: Generated, reference: list[list[int]] | None) -> int:
    """Print the part's table and verdict; 1 when a sequence differs from Hugging Face's."""
    print()
    if got.error:
        print(f"FAILED: generation: {got.error}")
        return 1
    row = got.row
    stages = f"{len(row.stages)} stages on {' + '.join(row.replicas[0].workers)}" if row else ""
    tokens = sum(o.completion_tokens for o in got.outputs)
    print(
        f"generation: {LM_NAME} (a tiny random Llama from a Hugging Face directory, {stages}): "
        f"{len(got.outputs)} sequences from {len(SINGLE) + 3} concurrent calls, {tokens} tokens "
        f"in {got.seconds:.1f} s ({tokens / max(got.seconds, 1e-9):.0f} tokens/s); "
        f"the stream came in {got.stream_chunks} chunks"
    )
    if row is not None:
        print(f"  the broker ran {row.gen_iterations} iterations for {row.tokens_generated} tokens")
    rows = []
    for prompt, o in zip(got.prompts, got.outputs, strict=True):
        per_token = sum(o.token_ms) / len(o.token_ms) if o.token_ms else 0.0
        text = (o.text or "").replace("\n", " ")
        rows.append(
            [
                prompt[:28],
                repr(text[:32]),
                str(o.completion_tokens),
                o.finish_reason,
                f"{o.ttft_ms:.0f}",
                f"{per_token:.1f}",
            ]
        )
    header = ["prompt", "text (random weights)", "tokens", "finish", "ttft ms", "ms/token"]
    print(table(rows, header))
    if reference is None:
        return 0
    wrong = [p for p, o, e in zip(got.prompts, got.outputs, reference, strict=True) if o.ids != e]
    if wrong:
        print(f"FAILED: {len(wrong)} sequences differ from Hugging Face generate: {wrong}")
        return 1
    print("OK: every sequence's tokens equal Hugging Face's greedy generate on the same directory")
    return 0
