"""Generation through a real mesh: a tiny Llama saved with `save_pretrained` deployed in two
stages on two workers (an iteration in flight per stage), its greedy tokens through the paged KV
cache equal to Hugging Face's own `generate`; Llama, Qwen2, Mistral, GPT-2 and OPT directories in
one and two stages too; streams that join to the call's result, stop strings, chats, the
refusals at the door, the demo's part, and an undeploy that lets a running stream end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from client_sdk import demo_generation, errors
from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh.modelio.tokenizer import TextCodec, read_tokenizer
from tests.support.lm import EOS_ID, hf_generate, tiny_lm_dir
from tests.support.mesh import FAST, roots_at
from tests.support.preemption import (
    PREEMPTED,
    PREEMPTED_NEW,
    preempted_reference,
    three_blocks_share,
)
from tests.support.waiting import until, until_blocking

PROMPTS = ["The quick brown fox", "Once upon a time", "Numbers: 1 2 3"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalMesh, Path]:
    root = tmp_path_factory.mktemp("gen")
    model_dir = tiny_lm_dir(root / "tiny-llama", "llama", seed=5, max_positions=64)
    # Two iterations in flight per replica, one per stage (the broker's default is one: the
    # CLI, gateway and demo tests run that): the tokens are the same either way.
    with LocalMesh(
        cpu_workers=2,
        memory_budget="8MiB",
        broker_args=["--gen-groups", "0"],
        **roots_at(root),
        **FAST,
    ) as mesh:
        with mesh.client() as c:
            c.deploy("lm", hf=str(model_dir), stages=2, replicas=1, max_seqs=4)
        yield mesh, model_dir


def test_greedy_generation_equals_hugging_face(lm: tuple[LocalMesh, Path]) -> None:
    mesh, model_dir = lm
    codec = TextCodec.from_files(read_tokenizer(model_dir))
    prompts_ids = [codec.encode(t) for t in PROMPTS]
    expected = hf_generate(model_dir, prompts_ids, 12, ignore_eos=True)
    with mesh.client() as c:
        # One call, three prompts batched together in the replica's iterations.
        outs = c.generate("lm", PROMPTS, max_tokens=12, ignore_eos=True)
        assert [o.ids for o in outs] == expected
        assert [o.finish_reason for o in outs] == ["length"] * 3
        assert [o.text for o in outs] == [codec.decode(e) for e in expected]
        assert [o.prompt_tokens for o in outs] == [len(i) for i in prompts_ids]
        assert all(o.completion_tokens == 12 and len(o.token_ms) == 11 for o in outs)
        # From ids, alone: the same tokens.
        one = c.generate("lm", ids=prompts_ids[1], max_tokens=12, ignore_eos=True)
        assert one.ids == expected[1]


def test_a_stream_joins_to_the_result(lm: tuple[LocalMesh, Path]) -> None:
    mesh, _ = lm
    with mesh.client() as c:
        whole = c.generate("lm", "Hello! How", max_tokens=10, ignore_eos=True)
        with c.generate_stream("lm", "Hello! How", max_tokens=10, ignore_eos=True) as stream:
            chunks = list(stream)
        assert [t for ch in chunks for t in ch.ids] == whole.ids
        assert "".join(ch.text or "" for ch in chunks) == whole.text
        assert chunks[-1].finish_reason == "length"
        assert all(ch.finish_reason is None for ch in chunks[:-1])


def test_eos_and_stop_strings_end_a_sequence(lm: tuple[LocalMesh, Path]) -> None:
    mesh, _ = lm
    with mesh.client() as c:
        free = c.generate("lm", "The quick brown fox", max_tokens=20, ignore_eos=True)
        # A stop id: the sequence ends there, the token kept.
        cut = free.ids[3]
        stopped = c.generate("lm", "The quick brown fox", max_tokens=20, stop_ids=[cut])
        k = free.ids.index(cut)
        assert stopped.ids == free.ids[: k + 1] and stopped.finish_reason == "stop"
        # A stop string: the text ends before it.
        assert free.text
        word = free.text[len(free.text) // 2 :][:3]
        if word:
            by_text = c.generate("lm", "The quick brown fox", max_tokens=20, stop=[word])
            assert by_text.finish_reason == "stop"
            assert by_text.text == free.text[: free.text.index(word)]
    # The model's own eos ends it unless told otherwise, as Hugging Face's does.
    codec = TextCodec.from_files(read_tokenizer(lm[1]))
    texts = ["Hello!", "Numbers: 42", "Café", "A language model"]
    expected = hf_generate(lm[1], [codec.encode(t) for t in texts], 30)
    with mesh.client() as c:
        outs = c.generate("lm", texts, max_tokens=30)
    assert [o.ids for o in outs] == expected
    for o in outs:
        assert o.finish_reason == ("stop" if o.ids[-1] == EOS_ID else "length")


def test_the_door_refuses_what_could_never_run(lm: tuple[LocalMesh, Path]) -> None:
    mesh, _ = lm
    with mesh.client() as c:
        with pytest.raises(errors.BadRequest, match="max_context"):
            c.generate("lm", ids=list(range(3, 60)), max_tokens=20)
        with pytest.raises(errors.BadRequest, match="vocabulary"):
            c.generate("lm", ids=[10**6], max_tokens=2)
        with pytest.raises(errors.ModelNotFound):
            c.generate("nope", "hi", max_tokens=2)
        # The mesh still generates after the refusals.
        assert len(c.generate("lm", "Hi", max_tokens=3, ignore_eos=True).ids) == 3


def test_concurrent_calls_batch_and_each_gets_its_own(lm: tuple[LocalMesh, Path]) -> None:
    mesh, model_dir = lm
    codec = TextCodec.from_files(read_tokenizer(model_dir))
    texts = [f"{t} {k}" for k in range(3) for t in PROMPTS]
    expected = hf_generate(model_dir, [codec.encode(t) for t in texts], 8, ignore_eos=True)

    async def main() -> list[list[int]]:
        async with AsyncClient(mesh.frontend, timeout=60) as c:
            outs = await asyncio.gather(
                *(c.generate("lm", t, max_tokens=8, ignore_eos=True) for t in texts)
            )
            status = await c.status()
        row = next(m for m in status.models if m.name == "lm")
        assert row.tokens_generated >= 8 * len(texts) and row.running_seqs == 0
        return [o.ids for o in outs]

    assert asyncio.run(main()) == expected


def test_chat_messages_go_through_the_chat_template(lm: tuple[LocalMesh, Path]) -> None:
    mesh, model_dir = lm
    codec = TextCodec.from_files(read_tokenizer(model_dir))
    chat = [{"role": "user", "content": "Hello! How are you today?"}]
    expected = hf_generate(model_dir, [codec.encode_chat(chat)], 6, ignore_eos=True)
    with mesh.client() as c:
        out = c.generate("lm", messages=chat, max_tokens=6, ignore_eos=True)
    assert out.ids == expected[0]
    assert out.prompt_tokens == len(codec.encode_chat(chat))


def test_a_client_follows_a_model_deployed_again_with_another_tokenizer(
    lm: tuple[LocalMesh, Path],
) -> None:
    # The same weights with another chat template: another tokenizer to a client (the prompt
    # of a chat is other tokens), as a new version of a model deployed under its old name.
    mesh, model_dir = lm
    other = shutil.copytree(model_dir, model_dir.parent / "other-template")  # (a data root)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}Question: {{ messages[-1]['content'] }}\nAnswer:"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    chat = [{"role": "user", "content": "Hello! How are you today?"}]
    asked = {"messages": chat, "max_tokens": 6, "ignore_eos": True}
    with mesh.client() as long_lived, mesh.client() as streams, mesh.client() as operator:
        operator.deploy("again", hf=str(model_dir), stages=1, replicas=1, max_seqs=2)
        try:
            before = long_lived.generate("again", **asked)  # its codec now kept
            with streams.generate_stream("again", **asked) as stream:  # this one's too
                assert [t for chunk in stream for t in chunk.ids] == before.ids
            operator.undeploy("again")
            operator.deploy("again", hf=str(other), stages=1, replicas=1, max_seqs=2)
            with mesh.client() as fresh:
                want = fresh.generate("again", **asked)
            assert want.prompt_tokens != before.prompt_tokens  # (another prompt indeed)
            # Each long-lived client's kept codec is refused; it fetches the new one.
            with streams.generate_stream("again", **asked) as stream:
                chunks = list(stream)
            assert [t for chunk in chunks for t in chunk.ids] == want.ids
            assert "".join(chunk.text or "" for chunk in chunks) == want.text
            after = long_lived.generate("again", **asked)
            assert (after.ids, after.text, after.prompt_tokens) == (
                want.ids,
                want.text,
                want.prompt_tokens,
            )
        finally:
            with contextlib.suppress(errors.ModelNotFound):
                operator.undeploy("again")


def test_a_stream_closed_early_stops_its_sequence(lm: tuple[LocalMesh, Path]) -> None:
    mesh, _ = lm

    async def main() -> None:
        async with AsyncClient(mesh.frontend, timeout=60) as c:
            before = await c.status()
            start = next(m for m in before.models if m.name == "lm").tokens_generated
            stream = c.generate_stream("lm", "Once upon", max_tokens=40, ignore_eos=True)
            async with stream:
                got = []
                async for chunk in stream:
                    got.append(chunk)
                    if len(got) == 2:
                        break
            assert len(got) == 2 and stream.generations is None

            made = -1

            async def stopped() -> bool:
                nonlocal made
                row = next(m for m in (await c.status()).models if m.name == "lm")
                made = -1 if row.running_seqs or row.waiting_seqs else row.tokens_generated
                return made >= 0

            await until(stopped, "the closed stream's sequence to leave the broker", poll=0.05)
            # Freed on the broker well before its 40 tokens (a few were on their way).
            assert 0 <= made - start < 40
            # And the model generates on.
            assert len((await c.generate("lm", "Hi", max_tokens=3, ignore_eos=True)).ids) == 3

    asyncio.run(main())


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "opt"])
def test_every_architecture_in_one_and_two_stages_equals_hugging_face(
    lm: tuple[LocalMesh, Path], arch: str, stages: int
) -> None:
    """The exactness table's rows: each architecture, whole and cut in two, prompts of
    different lengths batched together, greedy tokens equal to HF `generate`'s."""
    mesh, llama_dir = lm
    # Under the mesh's data root (the module's directory), beside the module's Llama.
    name = f"{arch}-{stages}"
    model_dir = tiny_lm_dir(llama_dir.parent / f"tiny-{name}", arch, seed=6, max_positions=48)
    codec = TextCodec.from_files(read_tokenizer(model_dir))
    prompts_ids = [codec.encode(t) for t in PROMPTS]
    expected = hf_generate(model_dir, prompts_ids, 10, ignore_eos=True)
    with mesh.client() as c:
        c.deploy(name, hf=str(model_dir), stages=stages, replicas=1)
        try:
            outs = c.generate(name, PROMPTS, max_tokens=10, ignore_eos=True)
            assert [o.ids for o in outs] == expected
            # Its context is config.json's (n_positions: GPT-2's name for it).
            with pytest.raises(errors.BadRequest, match="max_context"):
                c.generate(name, ids=[3] * 40, max_tokens=9)
        finally:
            c.undeploy(name)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "opt"])
def test_every_architecture_equals_hugging_face_across_preemption_and_resume(
    lm: tuple[LocalMesh, Path], arch: str, stages: int
) -> None:
    """The exactness table's preemption column: three sequences whose prompts fit a block each
    and which grow to two as they decode, on a deployment whose KV share on each worker holds
    three blocks: when one crosses into its second block the newest is preempted (its blocks
    freed), and joins again later with its KV parked in host memory and copied back, or
    recomputed from its prompt and the tokens it had drawn, whichever the workers measured
    cheaper (each forced in turn: tests/scenarios/test_generation_preemption.py). Every output
    still equals HF `generate`'s greedy tokens."""
    mesh, llama_dir = lm
    model_dir, expected = preempted_reference(llama_dir.parent, arch)
    name = f"{arch}-{stages}-preempted"
    with mesh.client() as c:
        budget = min(w.budget_bytes for w in c.status().workers)
        share = three_blocks_share(arch, stages, budget)
        row = c.deploy(name, hf=str(model_dir), stages=stages, max_seqs=3, kv_share=share)
        try:
            # The share was sized for the layers cut evenly over the stages: [start, stop) of
            # embed, 4 layers, head.
            assert [s.blocks for s in row.stages] == ([[0, 6]] if stages == 1 else [[0, 3], [3, 6]])
            outs = c.generate(name, PREEMPTED, max_tokens=PREEMPTED_NEW, ignore_eos=True)
            assert [o.ids for o in outs] == expected
            assert [o.finish_reason for o in outs] == ["length"] * 3
            status = next(m for m in c.status().models if m.name == name)
            assert status.preemptions >= 1, status.preemptions
            assert status.swaps + status.recomputes == status.preemptions  # each resumed
            assert status.running_seqs == status.waiting_seqs == 0
        finally:
            c.undeploy(name)


def test_the_demos_generation_part_checks_every_token(
    lm: tuple[LocalMesh, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    mesh, llama_dir = lm
    model_dir = demo_generation.prepare(llama_dir.parent / "demo")
    try:
        got = asyncio.run(demo_generation.run(mesh.frontend, model_dir))
        reference = demo_generation.expected(model_dir)
        assert demo_generation.report(got, reference) == 0
        assert "OK: every sequence's tokens equal" in capsys.readouterr().out
        assert len(got.outputs) == len(got.prompts) == len(reference)
        assert got.stream_chunks == got.outputs[-1].completion_tokens
        # A sequence that differs is reported as a failure.
        reference[2] = [*reference[2][:-1], (reference[2][-1] + 1) % 300]
        assert demo_generation.report(got, reference) == 1
        assert "FAILED: 1 sequences differ" in capsys.readouterr().out
    finally:
        with mesh.client() as c:
            c.undeploy(demo_generation.LM_NAME)


def test_a_seeded_draw_is_the_same_alone_and_batched(lm: tuple[LocalMesh, Path]) -> None:
    mesh, _ = lm
    kw = {"max_tokens": 12, "temperature": 1.0, "top_k": 50, "seed": 11, "ignore_eos": True}

    async def main() -> tuple[list[int], list[list[int]], list[int]]:
        async with AsyncClient(mesh.frontend, timeout=60) as c:
            alone = await c.generate("lm", "Once upon a time", **kw)
            crowd = await asyncio.gather(
                c.generate("lm", "Once upon a time", **kw),
                *(c.generate("lm", t, max_tokens=12, ignore_eos=True) for t in PROMPTS),
            )
            other = await c.generate("lm", "Once upon a time", **{**kw, "seed": 12})
        return alone.ids, [o.ids for o in crowd], other.ids

    alone, crowd, other = asyncio.run(main())
    assert crowd[0] == alone and other != alone


def test_an_undeploy_lets_a_running_generation_end_and_refuses_new_calls(
    lm: tuple[LocalMesh, Path],
) -> None:
    """An operator undeploys a model mid-stream: the stream runs to its end with the tokens it
    would have had undisturbed, a new call is refused meanwhile, the undeploy is answered once
    the stream has ended, saying so, and the model is gone."""
    mesh, model_dir = lm
    prompt, n = "Once upon a time", 48
    with mesh.client() as c, mesh.client() as op, mesh.client() as look:
        c.deploy("lm-drain", hf=str(model_dir), stages=1, replicas=1)
        whole = c.generate("lm-drain", prompt, max_tokens=n, ignore_eos=True)

        def state() -> str | None:
            row = next((m for m in look.status().models if m.name == "lm-drain"), None)
            return None if row is None else row.state

        (row,) = [m for m in look.status().models if m.name == "lm-drain"]
        worker = mesh.child(row.replicas[0].workers[0]).proc
        got: list[int] = []
        with ThreadPoolExecutor(1) as pool:
            with c.generate_stream("lm-drain", prompt, max_tokens=n, ignore_eos=True) as stream:
                for chunk in stream:
                    if not got:  # the first token: undeploy while the rest are to come
                        # Its worker held still meanwhile (well within its heartbeats' grace),
                        # so that the generation is surely still running when the undeploy
                        # comes, however fast it would otherwise end.
                        worker.send_signal(signal.SIGSTOP)
                        try:
                            undeploy = pool.submit(op.undeploy, "lm-drain")
                            until_blocking(lambda: state() == "draining", "the model draining")
                            with pytest.raises(errors.ModelNotFound, match="being undeployed"):
                                look.generate("lm-drain", "Hi", max_tokens=2)
                        finally:
                            worker.send_signal(signal.SIGCONT)
                    got += chunk.ids
            done = undeploy.result(timeout=60)
        assert got == whole.ids
        assert (done.drained, done.cut) == (1, 0) and done.waited_s > 0
        assert state() is None
