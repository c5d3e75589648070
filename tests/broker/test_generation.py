"""The broker's generation room in process: a real Hugging Face directory read for real, two
stages on two fake workers, a fake clock, and every message out asserted exactly (the Runs with
their `GenStep`s, `GenChunk`, `Generated`, `FreeSeqs`, errors with their codes and reasons)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from broker.core import BACKEND, CLIENT
from broker.generation import CLIENT_PROBE_S, KV_RETRY_S, PARK_WAIT_S
from broker.lm_files import LmFiles, read_lm_files
from broker.state import Phase, Residency
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.transport import PeerGone
from tests.support.broker import CLIENT_A, CLIENT_B, MIB, kinds, only, ref
from tests.support.generation import (
    VOCAB,
    Gen,
    Out,
    freed,
    ids_of,
    out_of,
    parked,
    refused,
    run_of,
    steps,
    tokens,
)
from tests.support.lm import BOS, BOS_ID, CHAT_TEMPLATE, EOS, EOS_ID, tiny_lm_dir


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_lm_dir(tmp_path_factory.mktemp("gen") / "tiny", layers=1, hidden=8)


@pytest.fixture(scope="module")
def files(lm_dir: Path) -> LmFiles:
    got = read_lm_files(str(lm_dir))
    assert got.error is None and got.vocab_size == VOCAB and got.max_positions == 64
    return got


# ====================================================================== the door


def test_the_door_refuses_what_could_never_run(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)

    def why(prompts: list[list[int]], max_tokens: int = 4) -> tuple[Code, str]:
        err = refused(
            g,
            p.Generate(
                id=9, model="lm", prompts=prompts, sampling=p.Sampling(max_tokens=max_tokens)
            ),
        )
        return err.code, err.reason

    assert why([]) == (Code.BAD_REQUEST, "generate needs at least one prompt")
    assert why([[1, 2], []]) == (
        Code.BAD_REQUEST,
        "prompt 1 is empty: give at least one token id",
    )
    assert why([[1, VOCAB]]) == (
        Code.BAD_REQUEST,
        f"prompt 0 holds token id {VOCAB}, outside the vocabulary of 'lm' ({VOCAB} ids)",
    )
    # The config's max_position_embeddings (64) is the limit: 10 + 55 is one over.
    assert why([[1] * 10], 55) == (
        Code.BAD_REQUEST,
        "prompt 0 has 10 tokens and max_tokens is 55: 65 is over the max_context of 'lm' (64)",
    )
    err = refused(g, p.Generate(id=9, model="nope", prompts=[[1]]))
    assert (err.code, err.reason) == (Code.MODEL_NOT_FOUND, "no model 'nope' (deployed: lm)")
    # Nothing was queued or sent by the refusals; the limit itself is taken.
    assert g.h.out() == [] and g.figures() == (0, 0, 0, 0)
    out = g.generate(10, [[1] * 10], max_tokens=54)
    assert steps(g.first(out)) == [(steps(run_of(out, g.w0))[0][0], 0, 10, 0)]


def test_the_specs_max_context_wins_over_the_config(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, max_context=16)
    err = refused(
        g, p.Generate(id=3, model="lm", prompts=[[1] * 10], sampling=p.Sampling(max_tokens=7))
    )
    assert (err.code, err.reason) == (
        Code.BAD_REQUEST,
        "prompt 0 has 10 tokens and max_tokens is 7: 17 is over the max_context of 'lm' (16)",
    )
    out = g.client(p.TokenizerInfo(id=4, model="lm"))
    assert [m.max_context for m in only(out, p.TokenizerReply)] == [16]
    assert only(g.generate(5, [[1] * 10], max_tokens=6), p.Run)


def test_max_tokens_none_fills_each_prompts_context(lm_dir: Path, files: LmFiles) -> None:
    # As OpenAI's chat without max_tokens: each sequence runs until prompt + new tokens fill the
    # context (12 here), so prompts of 10 and 9 tokens get 2 and 3 new ones.
    g = Gen(lm_dir, files, max_context=12, gen_groups=1)
    run = g.first(g.generate(5, [[1] * 10, [1] * 9], max_tokens=None))
    (a, *_), (b, *_) = steps(run)
    run = run_of(g.step(run, [11, 21]), g.w0)
    out = g.step(run, [12, 22])
    assert [o for o in out if o[2] in [f[2] for f in freed(a)]] == freed(a)
    run = run_of(out, g.w0)
    assert [s for s, *_ in steps(run)] == [b]  # the first ended at its context's end
    g.step(run, [23])
    ((generated,),) = [[m for m in g.finals(5)]]
    assert isinstance(generated, p.Generated)
    got = [(o.ids, o.finish, o.prompt_tokens) for o in generated.outputs]
    assert got == [([11, 12], "length", 10), ([21, 22, 23], "length", 9)]
    g.answered_once()
    # A prompt that fills the context leaves no room; nor does a model of no known context.
    err = refused(
        g, p.Generate(id=6, model="lm", prompts=[[1] * 12], sampling=p.Sampling(max_tokens=None))
    )
    assert (err.code, err.reason) == (
        Code.BAD_REQUEST,
        "prompt 0 has 12 tokens: the max_context of 'lm' (12) leaves no room for a new one",
    )
    unknown = Gen(lm_dir, dataclasses.replace(files, max_positions=None))
    err = refused(
        unknown, p.Generate(id=7, model="lm", prompts=[[1]], sampling=p.Sampling(max_tokens=None))
    )
    assert (err.code, err.reason) == (
        Code.BAD_REQUEST,
        "'lm' has no known context length (no max_context in its deploy, no "
        "max_position_embeddings in its config): give max_tokens",
    )


def test_a_model_not_from_a_directory_does_not_generate(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    g.h.deploy("mlp", [MIB], replicas=1)
    g.h.out()
    for msg in (p.Generate(id=2, model="mlp", prompts=[[1]]), p.TokenizerInfo(id=3, model="mlp")):
        err = refused(g, msg)
        assert err.code is Code.BAD_REQUEST
        assert err.reason.startswith("'mlp' is not a language model (deployed from a factory); ")
        assert "LlamaForCausalLM" in err.reason


def test_a_directory_of_another_architecture_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    g = Gen(tmp_path, read_lm_files(str(tmp_path)))
    err = refused(g, p.Generate(id=2, model="lm", prompts=[[1]]))
    assert err.code is Code.BAD_REQUEST
    assert err.reason.startswith("'lm': its config.json names no architecture it supports; ")


def test_tokenizer_info_answers_the_directorys_tokenizer(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    out = g.client(p.TokenizerInfo(id=4, model="lm"), CLIENT_B)
    assert out == [
        (
            CLIENT,
            CLIENT_B,
            p.TokenizerReply(
                id=4,
                model="lm",
                tokenizer_json=files.tokenizer_json or "",
                chat_template=CHAT_TEMPLATE,
                eos_ids=[EOS_ID],
                bos_id=BOS_ID,
                max_context=64,
                bos_token=BOS,
                eos_token=EOS,
                digest=files.digest,
            ),
        )
    ]
    assert json.loads(files.tokenizer_json or "") == json.loads(
        (lm_dir / "tokenizer.json").read_text()
    )


def test_prompts_encoded_with_another_tokenizer_than_the_models_are_refused(
    tmp_path: Path, lm_dir: Path, files: LmFiles
) -> None:
    # The same directory with another chat template: another codec, another digest.
    other = tiny_lm_dir(tmp_path / "other", layers=1, hidden=8)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    assert len(files.digest) == 32 and read_lm_files(str(other)).digest != files.digest
    assert read_lm_files(str(lm_dir)).digest == files.digest  # the same files: the same digest
    g = Gen(lm_dir, files)
    err = refused(g, p.Generate(id=2, model="lm", prompts=[[1, 2]], tokenizer="0" * 32))
    assert (err.code, err.reason) == (
        Code.TOKENIZER_CHANGED,
        "'lm' was deployed again with another tokenizer than the one the prompts were encoded "
        "with; fetch it again",
    )
    assert g.h.out() == []
    # The model's own digest, or none (prompts of token ids), is taken.
    same = p.Generate(id=3, model="lm", prompts=[[1]], tokenizer=files.digest)
    assert only(g.client(same), p.Run)
    assert only(g.generate(4, [[1]]), p.Run)


def test_calls_before_the_files_are_read_wait_for_them(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, None)
    assert g.generate(5, [[1, 7, 8]], max_tokens=2) == []
    assert g.core.drain_reads() == [("lm", g.hf)]  # asked for once
    assert g.client(p.TokenizerInfo(id=6, model="lm")) == []
    assert g.generate(7, [[]]) == []  # checked once the files are known
    assert g.core.drain_reads() == []
    g.h.now = 0.25
    out = g.read(files)
    # Taken in their order of arrival.
    assert kinds(out) == [
        (g.w0, "load"),
        (g.w1, "load"),
        (g.w0, "run"),
        (CLIENT_A, "tokenizer_reply"),
        (CLIENT_A, "error"),
    ]
    assert only(out, p.Error) == [
        p.Error(
            id=7, code=str(Code.BAD_REQUEST), reason="prompt 0 is empty: give at least one token id"
        )
    ]
    run = g.first([o for o in out if o[0] == BACKEND])
    ((a, *_),) = steps(run)
    assert steps(run) == [(a, 0, 3, 0)] and ids_of(run) == [1, 7, 8]
    g.h.now = 0.5
    run = run_of(g.step(run, [11]), g.w0)
    assert steps(run) == [(a, 3, 1, 1)] and ids_of(run) == [11]
    g.h.now = 0.75
    # Timed from the call's own arrival (0), not from when its files were read.
    assert g.step(run, [12]) == [
        *freed(a),
        (
            CLIENT,
            CLIENT_A,
            p.Generated(id=5, outputs=[out_of([11, 12], "length", 3, 500.0, [250.0])]),
        ),
    ]
    g.answered_once()


# ====================================================================== continuous batching


def test_a_second_call_joins_the_running_one_midway(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, max_seqs=3)
    run = g.first(g.generate(1, [[1, 5, 6]], max_tokens=3))
    ((a, *_),) = steps(run)
    assert run.gen == p.GenStep(
        seqs=[
            p.SeqStep(seq=a, start=0, count=3, sampling=p.Sampling(max_tokens=3, ignore_eos=True))
        ]
    )
    # Two stages, two groups: the second call's prefill goes out at once, in the other one.
    other = run_of(g.generate(2, [[1, 9, 9, 9]], max_tokens=2, addr=CLIENT_B), g.w0)
    ((b, *_),) = steps(other)
    assert steps(other) == [(b, 0, 4, 0)] and ids_of(other) == [1, 9, 9, 9]
    # Both groups' iterations in flight: the next calls wait for one.
    assert g.generate(3, [[1, 4]], max_tokens=2) == []
    assert g.generate(4, [[1, 3]], max_tokens=1, addr=CLIENT_B) == []
    assert g.figures() == (2, 2, 0, 2)
    run = g.stage0(run)
    assert g.figures() == (2, 2, 0, 2)
    run = run_of(g.last(run, [{"tokens": tokens([11])}]), g.w0)
    # The first call's decode and the third's prefill, packed in one Run; the fourth waits
    # (max_seqs 3 for the whole replica).
    (_, (c, *_)) = steps(run)
    assert steps(run) == [(a, 3, 1, 1), (c, 0, 2, 0)] and ids_of(run) == [11, 1, 4]
    assert run.parts == [[run.id, 3]]
    assert g.figures() == (3, 1, 1, 3)
    other = run_of(g.step(other, [21]), g.w0)
    assert steps(other) == [(b, 4, 1, 1)] and ids_of(other) == [21]
    run = run_of(g.step(run, [12, 31]), g.w0)
    assert steps(run) == [(a, 4, 1, 2), (c, 2, 1, 1)] and ids_of(run) == [12, 31]
    # b ends (max_tokens): its call is answered, it is freed on every stage, and the fourth
    # call's prefill takes its place in its group.
    out = g.step(other, [22])
    other = run_of(out, g.w0)
    ((d, *_),) = steps(other)
    assert out == [
        *freed(b),
        (CLIENT, CLIENT_B, p.Generated(id=2, outputs=[out_of([21, 22], "length", 4)])),
        (BACKEND, g.w0, other),
    ]
    assert steps(other) == [(d, 0, 2, 0)] and ids_of(other) == [1, 3]
    assert g.figures() == (3, 0, 5, 6)
    assert g.step(run, [13, 32]) == [
        *freed(a, c),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([11, 12, 13], "length", 3)])),
        (CLIENT, CLIENT_A, p.Generated(id=3, outputs=[out_of([31, 32], "length", 2)])),
    ]
    assert g.step(other, [41]) == [
        *freed(d),
        (CLIENT, CLIENT_B, p.Generated(id=4, outputs=[out_of([41], "length", 2)])),
    ]
    assert g.figures() == (0, 0, 8, 6)
    g.answered_once()


def test_one_call_of_many_prompts_runs_them_together(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, max_seqs=3)
    run, other = g.firsts(g.generate(1, [[1, 5], [1, 6, 7], [1], [1, 8]], max_tokens=2))
    # Spread over the groups (each to the one with fewer, the first of equals): the first and
    # third packed in one Run, the second in the other; the fourth waits (max_seqs 3).
    (a, *_), (c, *_) = steps(run)
    ((b, *_),) = steps(other)
    assert (a, b, c) == (a, a + 1, a + 2)
    assert steps(run) == [(a, 0, 2, 0), (c, 0, 1, 0)] and ids_of(run) == [1, 5, 1]
    assert steps(other) == [(b, 0, 3, 0)] and ids_of(other) == [1, 6, 7]
    run = run_of(g.step(run, [10, 30]), g.w0)
    assert steps(run) == [(a, 2, 1, 1), (c, 1, 1, 1)]
    other = run_of(g.step(other, [20]), g.w0)
    assert steps(other) == [(b, 3, 1, 1)]
    out = g.step(run, [11, 31])
    run = run_of(out, g.w0)
    assert out == [*freed(a, c), (BACKEND, g.w0, run)]  # the call waits for its fourth
    assert steps(run) == [(a + 3, 0, 2, 0)]
    assert g.step(other, [21]) == freed(b)
    run = run_of(g.step(run, [40]), g.w0)
    assert g.step(run, [41]) == [
        *freed(a + 3),
        (
            CLIENT,
            CLIENT_A,
            p.Generated(
                id=1,
                outputs=[
                    out_of([10, 11], "length", 2),
                    out_of([20, 21], "length", 3),
                    out_of([30, 31], "length", 1),
                    out_of([40, 41], "length", 2),
                ],
            ),
        ),
    ]
    g.answered_once()


# ====================================================================== iterations in flight


def test_a_two_stage_replica_keeps_an_iteration_in_flight_per_stage(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    first = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(first)
    at1 = g.stage0(first)  # the first group's iteration is at stage 1 (w1)
    # The second call's prefill goes out at once, in the second group: stage 0 works on it
    # while stage 1 works on the first.
    out = g.generate(2, [[1, 6, 7]], max_tokens=2, addr=CLIENT_B)
    second = run_of(out, g.w0)
    ((b, *_),) = steps(second)
    assert out == [(BACKEND, g.w0, second)] and b != a
    assert steps(second) == [(b, 0, 3, 0)] and ids_of(second) == [1, 6, 7]
    assert second.id != at1.id and g.core.models["lm"].replicas[0].inflight == 2
    assert g.figures() == (2, 0, 0, 2)
    at1b = g.stage0(second)  # on to stage 1, and nothing else starts
    # Each group's next Run follows its own result only, the other's still in flight.
    out = g.last(at1, [{"tokens": tokens([10])}])
    first = run_of(out, g.w0)
    assert out == [(BACKEND, g.w0, first)] and steps(first) == [(a, 2, 1, 1)]
    at1 = g.stage0(first)
    out = g.last(at1b, [{"tokens": tokens([20])}])
    second = run_of(out, g.w0)
    assert out == [(BACKEND, g.w0, second)] and steps(second) == [(b, 3, 1, 1)]
    out = g.last(at1, [{"tokens": tokens([11])}])
    first = run_of(out, g.w0)
    assert out == [(BACKEND, g.w0, first)] and steps(first) == [(a, 3, 1, 2)]
    assert g.step(second, [21]) == [
        *freed(b),
        (CLIENT, CLIENT_B, p.Generated(id=2, outputs=[out_of([20, 21], "length", 3)])),
    ]
    assert g.step(first, [12]) == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([10, 11, 12], "length", 2)])),
    ]
    g.answered_once()
    assert g.figures() == (0, 0, 5, 5)


def test_by_default_one_iteration_holds_every_sequence_of_a_replica(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, gen_groups=1)
    first = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(first)
    at1 = g.stage0(first)
    # The second call waits for the iteration in flight, then joins it: one Run for both.
    assert g.generate(2, [[1, 6, 7]], max_tokens=2, addr=CLIENT_B) == []
    assert g.core.models["lm"].replicas[0].inflight == 1
    out = g.last(at1, [{"tokens": tokens([10])}])
    both = run_of(out, g.w0)
    ((_, *_), (b, *_)) = steps(both)
    assert out == [(BACKEND, g.w0, both)]
    assert steps(both) == [(a, 2, 1, 1), (b, 0, 3, 0)] and ids_of(both) == [10, 1, 6, 7]


def test_direct_iterations_of_two_groups_are_in_flight_at_once(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    for i, w in enumerate(("w0", "w1")):
        g.core.peers[w].info.peer_endpoint = f"tcp://127.0.0.1:{7000 + i}"
    out = g.generate(1, [[1, 5], [1, 6, 7]], max_tokens=1)
    # One iteration per group, each announced to both stages (a run of its own each).
    assert kinds(out) == [
        (g.w0, "load"),
        (g.w1, "load"),
        (g.w0, "run"),
        (g.w1, "run"),
        (g.w0, "run"),
        (g.w1, "run"),
    ]
    r0, r1, r2, r3 = only(out, p.Run)
    ((a, *_),) = steps(r0)
    assert (r0.id, r2.id, steps(r2)) == (r1.id, r3.id, [(a + 1, 0, 3, 0)])
    assert r0.id != r2.id and r0.ticket != r2.ticket and ids_of(r2) == [1, 6, 7]
    assert [g.core.peers[w].inflight_runs for w in ("w0", "w1")] == [2, 2]
    # The second group's answer comes first: the call waits for its first sequence.
    assert g.last(r3, [{"tokens": tokens([20])}]) == freed(a + 1)
    assert g.last(r1, [{"tokens": tokens([10])}]) == [
        *freed(a),
        (
            CLIENT,
            CLIENT_A,
            p.Generated(id=1, outputs=[out_of([10], "length", 2), out_of([20], "length", 3)]),
        ),
    ]
    g.answered_once()


def test_a_prefill_alone_in_its_group_beside_another_is_not_too_big(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=4))
    ((a, *_),) = steps(run)
    other = run_of(g.generate(2, [[1, 6, 7]], max_tokens=2, addr=CLIENT_B), g.w0)
    ((b, *_),) = steps(other)
    # b's prefill alone in its group, but a holds KV on the same workers: no verdict, it
    # waits again (first in line) and no prefill joins until memory is freed.
    assert no_space(g, g.stage0(other), g.w1) == freed(b)
    assert g.figures() == (1, 1, 0, 2) and g.told == []
    run = run_of(g.step(run, [10]), g.w0)
    assert steps(run) == [(a, 2, 1, 1)]


def test_a_prefill_refused_while_another_ended_is_run_again_not_too_big(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=1))
    ((a, *_),) = steps(run)
    other = run_of(g.generate(2, [[1, 6, 7]], max_tokens=2, addr=CLIENT_B), g.w0)
    ((b, *_),) = steps(other)
    # a ends (its blocks freed) before stage 1's no_space for b comes back: b found the memory
    # a held, and is alone only now. No verdict: it runs again, never refused too_big.
    assert g.step(run, [10])[:2] == freed(a)
    out = no_space(g, g.stage0(other), g.w1)
    assert [m for addr, m in g.told if addr == CLIENT_B] == []  # b's call not failed
    again = run_of(out, g.w0)
    assert steps(again) == [(b, 0, 3, 0)] and ids_of(again) == [1, 6, 7]


# ====================================================================== how a sequence ends


def test_eos_ends_a_sequence_unless_ignored(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], ignore_eos=False, max_tokens=8))
    ((a, *_),) = steps(run)
    other = run_of(g.generate(2, [[1, 6]], ignore_eos=True, max_tokens=2), g.w0)
    ((b, *_),) = steps(other)
    g.h.now = 0.5
    run = run_of(g.step(run, [40]), g.w0)
    # The second ignores eos (the config's, 2): it runs on.
    other = run_of(g.step(other, [EOS_ID]), g.w0)
    assert steps(other) == [(b, 2, 1, 1)] and ids_of(other) == [EOS_ID]
    g.h.now = 1.0
    # eos ends the first, the token kept.
    assert g.step(run, [EOS_ID]) == [
        *freed(a),
        (
            CLIENT,
            CLIENT_A,
            p.Generated(id=1, outputs=[out_of([40, EOS_ID], "stop", 2, 500.0, [500.0])]),
        ),
    ]
    g.h.now = 1.25
    assert g.step(other, [EOS_ID]) == [
        *freed(b),
        (
            CLIENT,
            CLIENT_A,
            p.Generated(id=2, outputs=[out_of([EOS_ID, EOS_ID], "length", 2, 500.0, [750.0])]),
        ),
    ]
    g.answered_once()


def test_stop_ids_end_a_sequence_and_a_stream_gets_every_token(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    run, other = g.firsts(g.generate(1, [[1, 5], [1, 6]], stream=True, stop_ids=[77], max_tokens=3))
    ((a, *_),) = steps(run)
    ((b, *_),) = steps(other)

    def chunk(index: int, new: int, finish: str | None = None) -> tuple[str, bytes, p.Message]:
        return (CLIENT, CLIENT_A, p.GenChunk(id=1, index=index, ids=[new], finish=finish))

    out = g.step(run, [10])
    run = run_of(out, g.w0)
    assert out == [chunk(0, 10), (BACKEND, g.w0, run)]
    assert steps(run) == [(a, 2, 1, 1)]
    assert g.step(other, [77]) == [chunk(1, 77, "stop"), *freed(b)]
    run = run_of(g.step(run, [11]), g.w0)
    assert g.step(run, [12]) == [
        chunk(0, 12, "length"),
        *freed(a),
        (
            CLIENT,
            CLIENT_A,
            p.Generated(
                id=1,
                outputs=[out_of([10, 11, 12], "length", 2), out_of([77], "stop", 2)],
            ),
        ),
    ]
    assert [m.ids for _, m in g.told if isinstance(m, p.GenChunk) and m.index == 0] == [
        [10],
        [11],
        [12],
    ]
    g.answered_once()


def test_stop_generate_mid_iteration_frees_after_its_result(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run, other = g.firsts(g.generate(1, [[1, 5], [1, 6]], stream=True, max_tokens=5))
    ((a, *_),) = steps(run)
    ((b, *_),) = steps(other)
    run = run_of(g.step(run, [10]), g.w0)
    other = run_of(g.step(other, [20]), g.w0)
    stage1 = g.stage0(other)
    # Stopped while the iteration holding it (its group's) runs: its stream ends at once, its
    # KV is freed only after that iteration's answer (a worker may still be writing it).
    assert g.client(p.StopGenerate(id=1, indexes=[1])) == [
        (CLIENT, CLIENT_A, p.GenChunk(id=1, index=1, ids=[], finish="stop"))
    ]
    # The other group's answer is not that one: it frees nothing.
    out = g.step(run, [11])
    run = run_of(out, g.w0)
    assert out == [(CLIENT, CLIENT_A, p.GenChunk(id=1, index=0, ids=[11])), (BACKEND, g.w0, run)]
    assert steps(run) == [(a, 3, 1, 2)]
    assert g.last(stage1, [{"tokens": tokens([21])}]) == freed(b)
    # The whole call stopped mid-iteration: answered at once with what it has, freed after.
    stage1 = g.stage0(run)
    assert g.client(p.StopGenerate(id=1)) == [
        (CLIENT, CLIENT_A, p.GenChunk(id=1, index=0, ids=[], finish="stop")),
        (
            CLIENT,
            CLIENT_A,
            p.Generated(
                id=1,
                outputs=[out_of([10, 11], "stop", 2), out_of([20], "stop", 2)],
            ),
        ),
    ]
    assert g.last(stage1, [{"tokens": tokens([12])}]) == freed(a)
    # A late stop changes nothing.
    assert g.client(p.StopGenerate(id=1)) == []
    g.answered_once()
    assert g.figures() == (0, 0, 3, 5)


def test_stopping_a_waiting_sequence_sends_nothing_to_workers(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, max_seqs=1)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=2))
    assert g.generate(2, [[1, 6]], max_tokens=2, addr=CLIENT_B) == []
    assert g.client(p.StopGenerate(id=2), CLIENT_B) == [
        (
            CLIENT,
            CLIENT_B,
            p.Generated(id=2, outputs=[p.GenOutput(ids=[], finish="stop", prompt_tokens=2)]),
        )
    ]
    assert g.figures() == (1, 0, 0, 1)
    ((a, *_),) = steps(run)
    run = run_of(g.step(run, [10]), g.w0)
    assert steps(run) == [(a, 2, 1, 1)]


def test_a_stream_whose_client_is_gone_stops_and_frees_its_kv(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, gen_groups=1)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=50, stream=True))
    ((a, *_),) = steps(run)
    assert g.generate(2, [[1, 6]], max_tokens=3, stream=True) == []
    out = g.step(run, [10])
    run = run_of(out, g.w0)
    (_, (b, *_)) = steps(run)
    # A full queue to the client (the high-water mark: OVERLOADED) stops nothing.
    full = FlowmeshError(Code.OVERLOADED, "peer queue full (high-water mark reached)")
    g.core.send_failed(CLIENT, CLIENT_A, only(out, p.GenChunk)[0], full, g.h.now)
    assert g.keep(g.h.out()) == []
    out = g.step(run, [11, 20])
    run = run_of(out, g.w0)
    assert steps(run) == [(a, 3, 1, 2), (b, 2, 1, 1)]
    # Call 1's chunk finds its client gone (PeerGone: no connection under that address): the
    # call stops, answered to nobody; its KV is freed once the iteration holding it is back.
    chunk = p.GenChunk(id=1, index=0, ids=[11])
    assert only(out, p.GenChunk)[0] == chunk
    g.core.send_failed(CLIENT, CLIENT_A, chunk, PeerGone("peer is not connected"), g.h.now)
    assert g.keep(g.h.out()) == []
    out = g.step(run, [12, 21])
    run = run_of(out, g.w0)
    assert out == [
        (CLIENT, CLIENT_A, p.GenChunk(id=2, index=0, ids=[21])),
        *freed(a),
        (BACKEND, g.w0, run),
    ]
    # The call whose chunk went out runs on; a late PeerGone of the stopped one changes nothing.
    assert steps(run) == [(b, 3, 1, 2)]
    g.core.send_failed(CLIENT, CLIENT_A, chunk, PeerGone("peer is not connected"), g.h.now)
    assert g.keep(g.h.out()) == []
    assert g.step(run, [22]) == [
        (CLIENT, CLIENT_A, p.GenChunk(id=2, index=0, ids=[22], finish="length")),
        *freed(b),
        (CLIENT, CLIENT_A, p.Generated(id=2, outputs=[out_of([20, 21, 22], "length", 2)])),
    ]
    assert g.finals(1) == [] and g.core.generation.calls == {} and g.core.ctx.outstanding == {}


def test_a_calls_client_is_probed_and_its_calls_stop_once_it_is_gone(
    lm_dir: Path, files: LmFiles
) -> None:
    # Nothing goes to the client of a blocking call before its answer (nor of a streamed one
    # waiting in the queue): a heartbeat every CLIENT_PROBE_S tells whether it is still there
    # (a killed client's calls held their KV to their end). Clients, not the workers: those
    # beats are the core's own.
    g = Gen(lm_dir, files, gen_groups=1)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=50))
    ((a, *_),) = steps(run)
    # B's is streamed, but waits in the queue: no chunk would tell either.
    assert g.generate(2, [[1, 6]], max_tokens=50, addr=CLIENT_B, stream=True) == []

    def probed(now: float) -> list[bytes]:
        g.h.now = now
        g.core.tick(now)
        out = g.h.out()
        return [addr for dest, addr, m in out if dest == CLIENT and isinstance(m, p.Heartbeat)]

    assert probed(CLIENT_PROBE_S - 0.1) == []
    assert sorted(probed(CLIENT_PROBE_S)) == sorted([CLIENT_A, CLIENT_B])
    assert probed(CLIENT_PROBE_S + 1) == []  # not again before another CLIENT_PROBE_S
    # A's heartbeat finds it gone: its call stops, answered to nobody, its KV freed once the
    # iteration holding it is back; B's runs on.
    g.core.send_failed(CLIENT, CLIENT_A, p.Heartbeat(), PeerGone("peer is not connected"), 2.0)
    assert g.keep(g.h.out()) == []
    out = g.step(run, [10])
    run = run_of(out, g.w0)
    (b,) = [s for s, *_ in steps(run)]
    assert b != a and [m for _, _, m in out if isinstance(m, p.FreeSeqs)] == [
        m for _, _, m in freed(a)
    ]
    assert probed(2 * CLIENT_PROBE_S) == [CLIENT_B]
    assert g.finals(1) == [] and list(g.core.generation.calls) == [(CLIENT_B, 2)]


# ====================================================================== KV memory


def no_space(g: Gen, run: p.Run, worker: bytes) -> Out:
    """`worker` could not place the KV blocks of `run`'s prefills."""
    err = p.Error(id=run.id, code=str(Code.NO_SPACE), reason="no free KV blocks")
    return g.keep(g.h.backend(worker, err))


def test_no_space_puts_the_prefills_back_and_the_decodes_run_on(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(run)
    # A long call in the other group, and one that waits for an idle group.
    other = run_of(g.generate(4, [[1, 9]], max_tokens=8, addr=CLIENT_B), g.w0)
    ((z, *_),) = steps(other)
    assert g.generate(2, [[1, 6, 7]], max_tokens=2, addr=CLIENT_B) == []
    run = run_of(g.step(run, [10]), g.w0)
    (_, (b, *_)) = steps(run)
    assert steps(run) == [(a, 2, 1, 1), (b, 0, 3, 0)]
    # Stage 1 has no room for b's prompt: b is freed everywhere and waits again; a runs on
    # alone, the very step it had, and nothing new joins until a sequence frees memory.
    out = no_space(g, g.stage0(run), g.w1)
    run = run_of(out, g.w0)
    assert out == [*freed(b), (BACKEND, g.w0, run)]
    assert steps(run) == [(a, 2, 1, 1)] and ids_of(run) == [10]
    assert g.figures() == (2, 1, 1, 4)
    assert g.generate(3, [[1, 8]], max_tokens=1) == []
    # Nor in the other group (the memory is the replica's).
    other = run_of(g.step(other, [90]), g.w0)
    assert steps(other) == [(z, 2, 1, 1)]
    run = run_of(g.step(run, [11]), g.w0)
    assert steps(run) == [(a, 3, 1, 2)]
    # a ends: b (first in line) and the third call's prefill join its group, the idle one.
    out = g.step(run, [12])
    run = run_of(out, g.w0)
    (b2, *_), (c, *_) = steps(run)
    assert out == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([10, 11, 12], "length", 2)])),
        (BACKEND, g.w0, run),
    ]
    assert steps(run) == [(b, 0, 3, 0), (c, 0, 2, 0)] and ids_of(run) == [1, 6, 7, 1, 8]
    assert b2 == b and len(g.finals(2, CLIENT_B)) == 0


def test_prefills_that_fail_together_join_one_at_a_time(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 4]], max_tokens=1))
    other = run_of(g.generate(2, [[1, 3]], max_tokens=1, addr=CLIENT_B), g.w0)
    ((z, *_),) = steps(run)
    ((x, *_),) = steps(other)
    # Both groups in flight: the call waits, then both its prompts join the first idle group.
    assert g.generate(3, [[1, 5], [1, 6, 7]], max_tokens=2) == []
    out = g.step(run, [40])
    run = run_of(out, g.w0)
    (a, *_), (b, *_) = steps(run)
    assert out == [
        *freed(z),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([40], "length", 2)])),
        (BACKEND, g.w0, run),
    ]
    assert steps(run) == [(a, 0, 2, 0), (b, 0, 3, 0)]
    assert g.step(other, [30]) == [
        *freed(x),
        (CLIENT, CLIENT_B, p.Generated(id=2, outputs=[out_of([30], "length", 2)])),
    ]
    # Nothing else runs on the replica: the two prefills try again one at a time, the second
    # only once the first is back (then in the other group, the smaller).
    out = no_space(g, run, g.w0)
    run = run_of(out, g.w0)
    assert out == [*freed(a, b), (BACKEND, g.w0, run)]
    assert steps(run) == [(a, 0, 2, 0)]
    out = g.step(run, [10])
    run, other = only(out, p.Run)
    assert kinds(out) == [(g.w0, "run"), (g.w0, "run")]
    assert steps(run) == [(a, 2, 1, 1)] and steps(other) == [(b, 0, 3, 0)]


def _beside_ranker(g: Gen) -> None:
    """Another model's stage holds memory on the last stage's worker (room may come later)."""
    key = ("ranker", 0)
    g.core.peers["w1"].resident[key] = Residency(key, 1 << 20, Phase.RESIDENT, 0.0)


def test_a_prefill_alone_beside_another_models_stages_waits_for_room(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, starvation_s=0.5)
    run = g.first(g.generate(1, [[1, 5, 6]], max_tokens=4))
    ((a, *_),) = steps(run)
    assert run.gen.evict_live is False
    _beside_ranker(g)
    # Not TOO_BIG, not an error: it waits at the head of the queue, tried again KV_RETRY_S on.
    assert no_space(g, g.stage0(run), g.w1) == freed(a)
    assert g.finals(1) == [] and g.figures()[:2] == (0, 1)
    assert g.tick(KV_RETRY_S / 2) == []
    run = run_of(g.tick(KV_RETRY_S), g.w0)
    assert steps(run) == [(a, 0, 3, 0)] and run.gen.evict_live is False
    # Past the starvation limit (0.5 s since it came) its try may evict the stages that hold
    # other models' live sequences.
    g.h.now = KV_RETRY_S
    assert no_space(g, g.stage0(run), g.w1) == freed(a)
    run = run_of(g.tick(2 * KV_RETRY_S + 0.01), g.w0)
    assert steps(run) == [(a, 0, 3, 0)] and run.gen.evict_live is True
    # Room found: it runs on as any other, and the next prefill asks nothing of others.
    run = run_of(g.step(run, [10]), g.w0)
    assert steps(run) == [(a, 3, 1, 1)] and run.gen.evict_live is False
    g.step(run, [11])
    assert g.core.generation.by_model["lm"].room_wait == ""


def test_a_sequence_waiting_for_room_tries_again_when_memory_is_freed(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, replicas=2, gen_groups=1, max_seqs=1)
    w2, w3 = on = (g.workers[2], g.workers[3])
    run_b = g.first(g.generate(1, [[1, 7]], max_tokens=2))
    ((b, *_),) = steps(run_b)
    run = g.first(g.generate(2, [[1, 5, 6]], max_tokens=4, addr=CLIENT_B), on=on)
    ((a, *_),) = steps(run)
    key = ("ranker", 0)
    g.core.peers["w3"].resident[key] = Residency(key, 1 << 20, Phase.RESIDENT, 0.0)
    assert no_space(g, g.stage0(run, on), w3) == [
        (BACKEND, w2, p.FreeSeqs(model="lm", stage=0, seqs=[a])),
        (BACKEND, w3, p.FreeSeqs(model="lm", stage=1, seqs=[a])),
    ]
    # b, on the other replica, ends before KV_RETRY_S: the memory it frees may be the room
    # a waits for, so a tries again at once (there: the replica with room).
    run_b = run_of(g.step(run_b, [20]), g.w0)
    out = g.step(run_b, [21])
    assert out[:3] == [
        *freed(b),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([20, 21], "length", 2)])),
    ]
    assert steps(run_of(out[3:], g.w0)) == [(a, 0, 3, 0)]


def test_a_call_waiting_for_room_past_its_deadline_says_what_it_waited_for(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5, 6]], max_tokens=4, timeout_ms=400))
    ((a, *_),) = steps(run)
    _beside_ranker(g)
    assert no_space(g, g.stage0(run), g.w1) == freed(a)
    run = run_of(g.tick(KV_RETRY_S), g.w0)
    assert no_space(g, g.stage0(run), g.w1) == freed(a)
    reason = (
        "generation not finished within 0.4 s (0 of 1 sequences ended); waiting for no KV "
        "room beside 'ranker' on the same workers: no free KV blocks"
    )
    assert g.tick(0.4) == [(CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.TIMEOUT), reason=reason))]
    g.answered_once()
    assert g.figures()[:2] == (0, 0)


def _both_parked(g: Gen, seq: int) -> None:
    """Each stage's worker says it parked `seq`'s KV (its answer to a FreeSeqs with park)."""
    for stage, w in enumerate((g.w0, g.w1)):
        answer = p.SeqsParked(model="lm", stage=stage, parked=[seq], dropped=[])
        assert g.keep(g.h.backend(w, answer)) == []


def _deploy_lm2(g: Gen, files: LmFiles) -> None:
    """A second language model, "lm2", on the same two workers, its files read."""
    spec = {"name": "lm2", "hf": g.hf, "stages": 2, "replicas": 1, "max_seqs": 4}
    for _, addr, m in g.h.client(CLIENT_A, p.Deploy(id=2, spec=spec)):
        ready = p.StageReady(id=m.id, model="lm2", stage=m.stage, nbytes=MIB, seconds=0.1)
        g.h.backend(addr, ready)
    g.core.files_read("lm2", g.hf, files, g.h.now)
    g.h.out()


def test_two_models_waiting_for_room_do_not_wake_each_other(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, gen_groups=1)
    _deploy_lm2(g, files)
    _beside_ranker(g)
    run_a = g.first(g.generate(1, [[1, 5, 6]], max_tokens=4))
    msg = p.Generate(id=2, model="lm2", prompts=[[1, 5]], sampling=p.Sampling(max_tokens=4))
    out = g.client(msg, CLIENT_B)
    for load in only(out, p.Load):
        done = p.Loaded(id=load.id, model="lm2", stage=load.stage, nbytes=MIB, seconds=0.1)
        g.h.backend(g.w0 if load.stage == 0 else g.w1, done)
    (run_b,) = only(out, p.Run)
    # Both lone prefills refused at stage 0: what each refusal frees is only what its own try
    # took, so neither wakes the other; each tries again KV_RETRY_S on.
    for run in (run_a, run_b):
        assert only(no_space(g, run, g.w0), p.Run) == []
    runs = only(g.tick(KV_RETRY_S), p.Run)
    assert sorted(r.model for r in runs) == ["lm", "lm2"]


def test_a_wait_for_room_starves_from_when_it_began_and_ends_with_its_call(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, starvation_s=2.0)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=40, timeout_ms=4000))
    ((a, *_),) = steps(run)
    for i, t in enumerate([0.5, 1.0, 1.5, 2.0, 2.5]):
        g.h.now = t
        run = run_of(g.step(run, [10 + i]), g.w0)
    # Generating for 2.6 s already, it is parked for room: its tries evict live stages only
    # once it has waited 2 s for room, not at once.
    _beside_ranker(g)
    g.h.now = 2.6
    assert no_space(g, g.stage0(run), g.w1) == parked(a)
    _both_parked(g, a)
    run = run_of(g.tick(2.6 + KV_RETRY_S), g.w0)
    assert steps(run) == [(a, 6, 1, 5)] and run.gen.evict_live is False
    g.h.now = 4.0
    assert no_space(g, g.stage0(run), g.w1) == parked(a)
    _both_parked(g, a)
    # Its call times out: the wait ends with it, and a later call of the model that waits
    # for something else (w0 busy) is no reason to evict anything.
    out = g.tick(4.0)
    assert out[-1][2].code == str(Code.TIMEOUT) and only(out, p.Run) == []
    g.answered_once()
    g.core.peers["w1"].resident.pop(("ranker", 0))
    w0 = g.core.peers["w0"]
    w0.inflight_runs = w0.max_inflight
    assert g.generate(2, [[1, 7]], max_tokens=1, timeout_ms=9000) == []
    w0.inflight_runs = 0
    g.h.now = 6.5
    for w in (g.w0, g.w1, b"part"):  # alive
        g.h.backend(w, p.Heartbeat())
    run = run_of(g.tick(6.5), g.w0)
    assert steps(run)[0][1:] == (0, 2, 0) and run.gen.evict_live is False


def test_a_lone_decode_out_of_memory_beside_another_model_is_parked_and_waits(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=4))
    ((a, *_),) = steps(run)
    run = run_of(g.step(run, [10]), g.w0)
    _beside_ranker(g)
    assert no_space(g, g.stage0(run), g.w1) == parked(a)
    assert g.finals(1) == [] and g.figures()[:2] == (0, 1)
    # Both stages kept its KV: once the wait is over it resumes from it.
    _both_parked(g, a)
    run = run_of(g.tick(KV_RETRY_S), g.w0)
    assert steps(run) == [(a, 2, 1, 1)]


def test_a_prefill_alone_on_a_worker_that_trains_waits_for_room(
    lm_dir: Path, files: LmFiles
) -> None:
    """A worker that trains lends serving's free memory to its training tasks and takes it back
    once a placement claims it (`gpu_worker.memory`): a lone prefill refused there waits and
    tries again, never too_big."""
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5, 6]], max_tokens=4))
    ((a, *_),) = steps(run)
    peer = g.core.peers["w1"]
    peer.info = msgspec.structs.replace(peer.info, train_bytes=1 << 20)
    assert no_space(g, g.stage0(run), g.w1) == freed(a)
    assert g.finals(1) == []
    assert "training on w1" in g.core.generation.by_model["lm"].room_wait
    run = run_of(g.tick(KV_RETRY_S), g.w0)
    assert steps(run) == [(a, 0, 3, 0)]
    run = run_of(g.step(run, [10]), g.w0)  # room given back: it runs on
    assert steps(run) == [(a, 3, 1, 1)]


def test_a_sequence_with_no_max_tokens_ends_length_where_its_kv_memory_ends(
    lm_dir: Path, files: LmFiles
) -> None:
    # max_tokens None (OpenAI's chat without one) runs to the context's end; a replica whose KV
    # memory ends first ends it there, "length", with the tokens it has, not TOO_BIG.
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5, 6]], max_tokens=None, stream=True))
    ((a, *_),) = steps(run)
    run = run_of(g.step(run, [10]), g.w0)
    assert no_space(g, g.stage0(run), g.w1) == [
        (CLIENT, CLIENT_A, p.GenChunk(id=1, index=0, ids=[], finish="length")),
        *freed(a),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([10], "length", 3)])),
    ]
    g.answered_once()


def test_a_prefill_that_fails_alone_is_too_big(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5, 6]], max_tokens=4))
    ((a, *_),) = steps(run)
    reason = (
        "a sequence of 3 prompt tokens + 4 new (7) does not fit the KV memory of 'lm''s stages "
        "even alone: no free KV blocks"
    )
    assert no_space(g, g.stage0(run), g.w1) == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.TOO_BIG), reason=reason)),
    ]
    g.answered_once()
    assert g.figures() == (0, 0, 0, 1)
    # The model still generates.
    assert steps(run_of(g.generate(2, [[1]], max_tokens=1), g.w0))[0][1:] == (0, 1, 0)


# ====================================================================== failures


def test_a_lost_worker_with_no_other_replica_fails_its_calls(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, max_seqs=2)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(run)
    other = run_of(g.generate(2, [[1, 6]], max_tokens=2, addr=CLIENT_B), g.w0)
    ((b, *_),) = steps(other)
    assert g.generate(3, [[1, 7]], max_tokens=2, addr=CLIENT_B) == []
    g.stage0(run)
    # w1 falls silent; w0 and the partitioner keep beating.
    g.h.now = 2.5
    g.h.backend(g.w0, p.Heartbeat())
    g.h.backend(b"part", p.Heartbeat())
    out = g.tick(4.0)
    reason = "worker w1 was lost and 'lm' has no live replica left"
    # Every group's sequences: their KV was on the same workers (freed on the one left).
    assert [o for o in out if isinstance(o[2], p.FreeSeqs | p.Error | p.Generated)] == [
        (BACKEND, g.w0, p.FreeSeqs(model="lm", stage=0, seqs=[a, b])),
        (CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.WORKER_LOST), reason=reason)),
        (CLIENT, CLIENT_B, p.Error(id=2, code=str(Code.WORKER_LOST), reason=reason)),
        (CLIENT, CLIENT_B, p.Error(id=3, code=str(Code.WORKER_LOST), reason=reason)),
    ]
    g.answered_once()
    assert g.figures() == (0, 0, 0, 2)


def test_sequences_of_a_lost_replica_start_again_on_another_from_their_tokens(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, replicas=2, gen_groups=1)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(run)
    run = run_of(g.step(run, [10]), g.w0)
    assert steps(run) == [(a, 2, 1, 1)]
    g.stage0(run)
    # w1 falls silent mid-iteration; the others keep beating.
    g.h.now = 2.5
    for w in [g.w0, b"part", *[x for x in g.workers if x not in (g.w0, g.w1)]]:
        g.h.backend(w, p.Heartbeat())
    out = g.tick(4.0)
    assert (BACKEND, g.w0, p.FreeSeqs(model="lm", stage=0, seqs=[a])) in out
    assert not [o for o in out if isinstance(o[2], p.Error | p.Generated)]
    # On the other replica: its prompt and its token prefilled again, its next one drawn.
    (again,) = [m for _, w, m in out if isinstance(m, p.Run) and w not in (g.w0, g.w1)]
    assert steps(again) == [(a, 0, 3, 1)] and ids_of(again) == [1, 5, 10]
    row = g.core.status(g.h.now).models[0]
    assert (row.running_seqs, row.restarts) == (1, 1)


def test_a_replica_scaled_down_runs_its_sequences_to_the_end_then_goes(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, replicas=2, gen_groups=1)
    model = g.core.models["lm"]
    first, second = model.replicas
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(run)
    # w0 busy with other work when a's first token comes: its next iteration waits, so
    # nothing runs on the replica while it is scaled down.
    nxt = g.stage0(run)
    w0 = g.core.peers["w0"]
    w0.inflight_runs = w0.max_inflight
    assert only(g.last(nxt, [{"tokens": tokens([10])}]), p.Run) == []
    assert first.inflight == 0
    # The autoscaler shrinks the model: the replica a runs on drains, kept while a lives.
    first.draining = True
    g.core.registry.autoscale(g.h.now, {})
    assert model.replicas == [first, second]
    # a goes on where its KV is; a new call takes the other replica.
    w0.inflight_runs = 0
    run = run_of(g.tick(0.1), g.w0)
    assert steps(run) == [(a, 2, 1, 1)]
    other = run_of(g.generate(2, [[1, 6]], max_tokens=1, addr=CLIENT_B), g.workers[2])
    assert ids_of(other) == [1, 6]
    run = run_of(g.step(run, [11]), g.w0)
    g.core.registry.autoscale(g.h.now, {})
    assert model.replicas == [first, second]
    assert g.step(run, [12]) == [
        *freed(a),
        (
            CLIENT,
            CLIENT_A,
            p.Generated(id=1, outputs=[out_of([10, 11, 12], "length", 2, gaps=[100.0, 0.0])]),
        ),
    ]
    g.core.registry.autoscale(g.h.now, {})
    assert model.replicas == [second]


def test_an_iteration_that_hangs_fails_its_calls(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, run_timeout_s=5.0)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(run)
    for t in (1.5, 3.0, 4.5):  # everyone beats; stage 0 never answers
        g.h.now = t
        for w in (g.w0, g.w1, b"part"):
            g.h.backend(w, p.Heartbeat())
    out = g.tick(5.0)
    reason = "worker w0 did not finish stage 0 of 'lm' within 5 s; its replica is being re-created"
    assert [o for o in out if isinstance(o[2], p.FreeSeqs | p.Error | p.Generated)] == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.TIMEOUT), reason=reason)),
    ]
    # Its answer, late, changes nothing.
    late = p.RunResult(id=run.id, model="lm", stage=0, tensors=[{"h": ref(2, 8)}])
    assert [o for o in g.keep(g.h.backend(g.w0, late)) if o[0] == CLIENT] == []
    g.answered_once()
    assert g.figures() == (0, 0, 0, 1)


def test_a_hung_iteration_fails_its_calls_and_the_other_groups_start_again_elsewhere(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, run_timeout_s=5.0, replicas=2)
    w2, w3 = g.workers[2:]
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))  # group 1 of the first replica
    ((a, *_),) = steps(run)
    other = run_of(g.generate(2, [[1, 6]], max_tokens=5, addr=CLIENT_B), g.w0)  # group 2
    ((b, *_),) = steps(other)
    # Group 2's iterations go on; group 1's never leaves stage 0 (w0 still beats).
    for t, new in ((1.5, 20), (3.0, 21), (4.5, 22)):
        g.h.now = t
        for w in [*g.workers, b"part"]:
            g.h.backend(w, p.Heartbeat())
        other = run_of(g.step(other, [new]), g.w0)
    assert steps(other) == [(b, 4, 1, 3)]
    out = g.tick(5.0)
    reason = "worker w0 did not finish stage 0 of 'lm' within 5 s; its replica is being re-created"
    # Only group 1's call fails; group 2's sequence starts again on the other replica from
    # its tokens (its KV on the given-up replica freed where its workers are still here).
    assert [o for o in out if isinstance(o[2], p.FreeSeqs | p.Error | p.Generated)] == [
        *freed(a, b),
        (CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.TIMEOUT), reason=reason)),
    ]
    again = g.first([o for o in out if isinstance(o[2], p.Load | p.Run)], on=(w2, w3))
    assert steps(again) == [(b, 0, 5, 3)] and ids_of(again) == [1, 6, 20, 21, 22]
    # Late answers from the given-up replica change nothing.
    late = p.RunResult(id=run.id, model="lm", stage=0, tensors=[{"h": ref(2, 8)}])
    assert [o for o in g.keep(g.h.backend(g.w0, late)) if o[0] == CLIENT] == []
    late = p.RunResult(id=other.id, model="lm", stage=0, tensors=[{"h": ref(1, 8)}])
    assert [o for o in g.keep(g.h.backend(g.w0, late)) if o[0] == CLIENT] == []
    # Group 2's call ends with the tokens it would have had on its first replica.
    again = run_of(g.step(again, [23], on=(w2, w3)), w2)
    assert steps(again) == [(b, 5, 1, 4)]
    assert g.step(again, [24], on=(w2, w3)) == [
        (BACKEND, w2, p.FreeSeqs(model="lm", stage=0, seqs=[b])),
        (BACKEND, w3, p.FreeSeqs(model="lm", stage=1, seqs=[b])),
        (
            CLIENT,
            CLIENT_B,
            p.Generated(
                id=2,
                outputs=[
                    out_of([20, 21, 22, 23, 24], "length", 2, 1500.0, [1500.0, 1500.0, 500.0, 0.0])
                ],
            ),
        ),
    ]
    g.answered_once()
    row = g.core.status(g.h.now).models[0]
    assert (row.running_seqs, row.waiting_seqs, row.restarts) == (0, 0, 1)


@pytest.mark.parametrize(
    ("tensors", "why"),
    [
        ([{"tokens": tokens([10, 20], "int32")}], "tokens: expected int64 [2], got int32 [2]"),
        ([{"tokens": tokens([10])}], "tokens: expected int64 [2], got int64 [1]"),
        ([{"tokens": tokens([10, 20, 30])}], "tokens: expected int64 [2], got int64 [3]"),
        ([{"logits": ref(2, VOCAB)}], "expected one part of one tensor 'tokens', got [['logits']]"),
        (
            [{"tokens": tokens([10, 20]), "x": ref(1)}],
            "expected one part of one tensor 'tokens', got [['tokens', 'x']]",
        ),
        ([{"tokens": tokens([10, VOCAB])}], f"token {VOCAB} is outside the vocabulary (0..319)"),
        ([{"tokens": tokens([-1, 20])}], "token -1 is outside the vocabulary (0..319)"),
    ],
)
def test_a_malformed_answer_fails_the_calls_never_hangs(
    lm_dir: Path, files: LmFiles, tensors: dict[str, p.TensorRef], why: str
) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    other = run_of(g.generate(2, [[1, 6]], max_tokens=3, addr=CLIENT_B), g.w0)
    ((b, *_),) = steps(other)
    assert g.generate(3, [[1, 7]], max_tokens=3) == []
    run = run_of(g.step(run, [10]), g.w0)
    (a, *_), (c, *_) = steps(run)
    reason = f"worker w1 answered generation badly: {why}"
    # The calls of that iteration fail; the other group's call runs on, to its end.
    assert g.last(g.stage0(run), tensors) == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.INTERNAL), reason=reason)),
        *freed(c),
        (CLIENT, CLIENT_A, p.Error(id=3, code=str(Code.INTERNAL), reason=reason)),
    ]
    other = run_of(g.step(other, [20]), g.w0)
    assert steps(other) == [(b, 2, 1, 1)]
    other = run_of(g.step(other, [21]), g.w0)
    assert g.step(other, [22]) == [
        *freed(b),
        (CLIENT, CLIENT_B, p.Generated(id=2, outputs=[out_of([20, 21, 22], "length", 2)])),
    ]
    g.answered_once()
    assert g.figures() == (0, 0, 4, 5)


def test_an_error_from_a_stage_fails_the_calls_in_it(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(run)
    err = p.Error(id=g.stage0(run).id, code=str(Code.MODEL_ERROR), reason="RuntimeError: boom")
    assert g.keep(g.h.backend(g.w1, err)) == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.MODEL_ERROR), reason="RuntimeError: boom")),
    ]
    g.answered_once()


def test_a_sequence_too_big_for_the_stages_fails_alone_not_those_batched_with_it(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, gen_groups=1)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=4))
    ((a, *_),) = steps(run)
    run = run_of(g.step(run, [10]), g.w0)
    assert g.generate(2, [[1] + [7] * 40], max_tokens=8, addr=CLIENT_B) == []
    assert g.generate(3, [[1, 8]], max_tokens=2, addr=CLIENT_B) == []
    run = run_of(g.step(run, [11]), g.w0)
    (_, (b, *_), (c, *_)) = steps(run)
    assert steps(run) == [(a, 3, 1, 2), (b, 0, 41, 0), (c, 0, 2, 0)]
    # Stage 1 finds the longest sequence's KV over the model's share there, even alone: that
    # call fails; the other prefill waits again (freed where placed), the decode runs on.
    why = f"'lm'/1: sequence {b} needs 6144 bytes of KV at 41 tokens, over its model's share"
    out = g.keep(
        g.h.backend(g.w1, p.Error(id=g.stage0(run).id, code=str(Code.TOO_BIG), reason=why))
    )
    run = run_of(out, g.w0)
    reason = (
        "a sequence of 41 prompt tokens + 8 new (49) does not fit the KV memory of 'lm''s "
        f"stages even alone: {why}"
    )
    assert out == [
        *freed(b),
        (CLIENT, CLIENT_B, p.Error(id=2, code=str(Code.TOO_BIG), reason=reason)),
        *freed(c),
        (BACKEND, g.w0, run),
    ]
    assert steps(run) == [(a, 3, 1, 2), (c, 0, 2, 0)] and ids_of(run) == [11, 1, 8]
    run = run_of(g.step(run, [12, 30]), g.w0)
    assert g.step(run, [13, 31]) == [
        *freed(a, c),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([10, 11, 12, 13], "length", 2)])),
        (CLIENT, CLIENT_B, p.Generated(id=3, outputs=[out_of([30, 31], "length", 2)])),
    ]
    g.answered_once()


def test_a_call_past_its_deadline_is_answered_timeout(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=8, timeout_ms=1000, stream=True))
    ((a, *_),) = steps(run)
    g.h.now = 0.5
    run = run_of(g.step(run, [10]), g.w0)
    stage1 = g.stage0(run)
    # Past its deadline while an iteration holds it: answered now, freed after that iteration.
    reason = "generation not finished within 1.0 s (0 of 1 sequences ended)"
    out = g.tick(1.0)
    assert [o for o in out if o[2].TYPE != "heartbeat"] == [
        (CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.TIMEOUT), reason=reason))
    ]
    assert g.last(stage1, [{"tokens": tokens([11])}]) == freed(a)
    g.answered_once()
    assert g.figures() == (0, 0, 1, 2)


def test_a_call_waiting_for_the_files_times_out(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, None)
    assert g.generate(1, [[1, 5]], timeout_ms=1000) == []
    assert g.client(p.TokenizerInfo(id=2, model="lm"), CLIENT_B) == []
    g.h.now = 0.5
    for w in (g.w0, g.w1, b"part"):
        g.h.backend(w, p.Heartbeat())
    out = g.tick(1.0)
    reason = "'lm': its files were not read within 1.0 s"
    assert [o for o in out if o[0] == CLIENT] == [
        (CLIENT, CLIENT_A, p.Error(id=1, code=str(Code.TIMEOUT), reason=reason))
    ]
    # Read at last: the call that still waits is answered; the timed-out one is not again.
    out = g.read(files)
    assert [m.TYPE for _, _, m in out] == ["tokenizer_reply"]
    g.answered_once()


def test_undeploying_answers_every_call(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    g.first(g.generate(1, [[1, 5]], max_tokens=3))
    out = g.client(p.Undeploy(id=8, model="lm", drain_s=0), CLIENT_B)
    assert [o for o in out if o[0] == CLIENT] == [
        (CLIENT, CLIENT_B, p.Undeployed(id=8, model="lm", cut=1)),
        (
            CLIENT,
            CLIENT_A,
            p.Error(id=1, code=str(Code.MODEL_NOT_FOUND), reason="'lm' was undeployed"),
        ),
    ]
    g.answered_once()


def test_undeploying_answers_calls_waiting_for_the_files(lm_dir: Path) -> None:
    g = Gen(lm_dir, None)
    assert g.generate(1, [[1, 5]]) == []
    out = g.client(p.Undeploy(id=8, model="lm", drain_s=0), CLIENT_B)
    assert [o for o in out if o[0] == CLIENT] == [
        (CLIENT, CLIENT_B, p.Undeployed(id=8, model="lm", cut=1)),
        (
            CLIENT,
            CLIENT_A,
            p.Error(id=1, code=str(Code.MODEL_NOT_FOUND), reason="'lm' was undeployed"),
        ),
    ]
    g.answered_once()


def test_an_answer_the_codec_refuses_fails_the_calls(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(run)
    short = p.TensorRef("int64", (1,), bytes(4))  # a frame shorter than its shape says
    msg = p.RunResult(id=g.stage0(run).id, model="lm", stage=1, tensors=[{"tokens": short}])
    with pytest.raises(p.DecodeError):
        g.h.backend(g.w1, msg)
    reason = "worker w1's answer was refused: tensor 'tokens': 4 bytes, but int64 x [1] needs 8"
    assert g.keep(g.h.out()) == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Error(id=1, code="bad_tensor", reason=reason)),
    ]
    g.answered_once()


def test_a_prefill_whose_stage_was_evicted_runs_again(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(run)
    err = p.Error(id=g.stage0(run).id, code=str(Code.NOT_RESIDENT), reason="evicted")
    out = g.keep(g.h.backend(g.w1, err))
    # Stage 1 loads again and the same iteration runs again from stage 0; nobody is answered.
    assert kinds(out) == [(g.w1, "load"), (g.w0, "run")]
    assert steps(run_of(out, g.w0)) == [(a, 0, 2, 0)] and g.told == []


def _a_decode_answered_not_resident(g: Gen) -> tuple[int, int, p.Run]:
    """a (a decode) and b (a prefill) in one iteration, which stage 1 answers NOT_RESIDENT: a
    is preempted, each stage told to park it; b runs again, through a Load, without a, which
    waits for the stages' answers. Returns a, b and b's Run."""
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    assert only(g.generate(2, [[1, 9]], max_tokens=3, addr=CLIENT_B), p.Run)  # the other group
    assert g.generate(3, [[1, 6, 7]], max_tokens=2) == []
    run = run_of(g.step(run, [10]), g.w0)
    (a, *_), (b, *_) = steps(run)
    err = p.Error(id=g.stage0(run).id, code=str(Code.NOT_RESIDENT), reason="evicted")
    out = g.keep(g.h.backend(g.w1, err))
    run = run_of(out, g.w0)
    assert out == [*parked(a), (BACKEND, g.w1, only(out, p.Load)[0]), (BACKEND, g.w0, run)]
    assert steps(run) == [(b, 0, 3, 0)] and g.told == []
    return a, b, run


def test_a_decode_whose_stage_was_evicted_resumes_from_the_kv_its_stages_parked(
    lm_dir: Path, files: LmFiles
) -> None:
    # The evicting worker parked the stage's live KV; the other stage held its own: freeing
    # the sequence everywhere (as before) threw both away and recomputed it.
    g = Gen(lm_dir, files)
    a, b, run = _a_decode_answered_not_resident(g)
    _both_parked(g, a)
    run = run_of(g.step(run, [20]), g.w0)
    # a goes on from its parked KV (prompt and first token but the last), beside b's decode.
    assert sorted(steps(run)) == sorted([(b, 3, 1, 1), (a, 2, 1, 1)])
    row = g.core.status(g.h.now).models[0]
    assert (row.preemptions, row.swaps, row.recomputes, row.restarts) == (1, 0, 0, 0)
    run = run_of(g.step(run, [21, 11]), g.w0)
    row = g.core.status(g.h.now).models[0]
    assert (row.preemptions, row.swaps, row.recomputes, row.restarts) == (1, 1, 0, 0)
    assert g.core.generation.parked == {}
    assert not [m for _, m in g.told if isinstance(m, p.Error)]  # b ended; nobody failed


def test_a_decode_whose_stage_lost_its_kv_starts_again_from_its_tokens(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    a, b, run = _a_decode_answered_not_resident(g)
    answer = p.SeqsParked(model="lm", stage=0, parked=[a], dropped=[])
    assert g.keep(g.h.backend(g.w0, answer)) == []
    # Stage 1 held no KV of it: w0's copy is dropped at once, and a starts again from its
    # tokens (no call fails) when it joins.
    answer = p.SeqsParked(model="lm", stage=1, parked=[], dropped=[a])
    assert g.keep(g.h.backend(g.w1, answer)) == freed(a)
    run = run_of(g.step(run, [20]), g.w0)
    assert sorted(steps(run)) == sorted([(b, 3, 1, 1), (a, 0, 3, 1)])
    run = run_of(g.step(run, [21, 11]), g.w0)
    row = g.core.status(g.h.now).models[0]
    assert (row.preemptions, row.swaps, row.recomputes, row.restarts) == (1, 0, 1, 0)
    assert not [m for _, m in g.told if isinstance(m, p.Error)]  # b ended; nobody failed


def _preempted(g: Gen) -> tuple[int, int, p.Run]:
    """a and b running in one group; their decodes find no room: b, the newest, is preempted
    (its workers told to park it), a runs on alone. Returns a, b and a's next Run."""
    run = g.first(g.generate(1, [[1, 5]], max_tokens=4))
    other = run_of(g.generate(3, [[1, 9]], max_tokens=1, addr=CLIENT_B), g.w0)
    ((z, *_),) = steps(other)
    assert g.generate(2, [[1, 6, 7]], max_tokens=4, addr=CLIENT_B) == []
    run = run_of(g.step(run, [10]), g.w0)  # b joins a's group
    assert g.step(other, [90]) == [
        *freed(z),
        (CLIENT, CLIENT_B, p.Generated(id=3, outputs=[out_of([90], "length", 2)])),
    ]
    run = run_of(g.step(run, [11, 20]), g.w0)
    (a, *_), (b, *_) = steps(run)
    out = no_space(g, run, g.w0)
    run = run_of(out, g.w0)
    assert out == [*parked(b), (BACKEND, g.w0, run)]
    assert steps(run) == [(a, 3, 1, 2)]
    assert g.figures() == (1, 1, 4, 5) and g.core.status(g.h.now).models[0].preemptions == 1
    # Held until a sequence of the model frees memory: a's next decode goes alone.
    run = run_of(g.step(run, [12]), g.w0)
    assert steps(run) == [(a, 4, 1, 3)]
    return a, b, run


def _a_ends(g: Gen, a: int, run: p.Run) -> Out:
    """a's last token: its call answered; what comes after that."""
    out = g.step(run, [13])
    assert out[:3] == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([10, 11, 12, 13], "length", 2)])),
    ]
    return out[3:]


def test_decodes_out_of_memory_preempt_the_newest_which_resumes_from_its_tokens(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    a, b, run = _preempted(g)
    # Its workers' answers are awaited before it joins its replica again (it would resume from
    # its KV): nothing goes out for it when a ends.
    assert _a_ends(g, a, run) == []
    # None said it kept b's KV within PARK_WAIT_S: its copies are dropped, and its prompt and
    # its token prefilled (their KV recomputed), its next one drawn.
    out = g.tick(PARK_WAIT_S)
    run = run_of(out, g.w0)
    assert out == [*freed(b), (BACKEND, g.w0, run)]
    assert steps(run) == [(b, 0, 4, 1)] and ids_of(run) == [1, 6, 7, 20]
    run = run_of(g.step(run, [21]), g.w0)
    assert steps(run) == [(b, 4, 1, 2)]
    row = g.core.status(g.h.now).models[0]
    assert (row.preemptions, row.swaps, row.recomputes) == (1, 0, 1)
    # Alone on the replica, a sequence that cannot grow could never fit: TOO_BIG.
    out = no_space(g, g.stage0(run), g.w1)
    assert out == [
        *freed(b),
        (
            CLIENT,
            CLIENT_B,
            p.Error(
                id=2,
                code=str(Code.TOO_BIG),
                reason=(
                    "a sequence of 3 prompt tokens + 4 new (7) does not fit the KV memory of "
                    "'lm''s stages even alone: no free KV blocks"
                ),
            ),
        ),
    ]
    g.answered_once()


def test_a_preempted_sequence_every_stage_parked_resumes_from_its_kv(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    a, b, run = _preempted(g)
    _both_parked(g, b)
    # Both stages kept its KV of prompt + first token but the last (4 - 1 = 3 tokens): it goes
    # on from there, its last token its one new id, as a decode does.
    run = run_of(_a_ends(g, a, run), g.w0)
    assert steps(run) == [(b, 3, 1, 1)] and ids_of(run) == [20]
    run = run_of(g.step(run, [21]), g.w0)
    assert steps(run) == [(b, 4, 1, 2)]
    row = g.core.status(g.h.now).models[0]
    assert (row.preemptions, row.swaps, row.recomputes) == (1, 1, 0)
    assert g.core.generation.parked == {}
    run = run_of(g.step(run, [22]), g.w0)
    assert g.step(run, [23]) == [
        *freed(b),
        (CLIENT, CLIENT_B, p.Generated(id=2, outputs=[out_of([20, 21, 22, 23], "length", 3)])),
    ]
    g.answered_once()


def test_a_sequence_one_stage_dropped_is_recomputed_and_its_other_copies_dropped(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    a, b, run = _preempted(g)
    answer = p.SeqsParked(model="lm", stage=0, parked=[b], dropped=[])
    assert g.keep(g.h.backend(g.w0, answer)) == []
    # Stage 1's worker found copying dearer than recomputing (or had no room): w0's copy is
    # dropped at once, and b is recomputed from its tokens when it joins again.
    answer = p.SeqsParked(model="lm", stage=1, parked=[], dropped=[b])
    assert g.keep(g.h.backend(g.w1, answer)) == freed(b)
    run = run_of(_a_ends(g, a, run), g.w0)
    assert steps(run) == [(b, 0, 4, 1)] and ids_of(run) == [1, 6, 7, 20]
    run = run_of(g.step(run, [21]), g.w0)
    row = g.core.status(g.h.now).models[0]
    assert (row.preemptions, row.swaps, row.recomputes) == (1, 0, 1)
    # A late or stray answer changes nothing.
    late = p.SeqsParked(model="lm", stage=0, parked=[b, 12345], dropped=[777])
    assert g.keep(g.h.backend(g.w0, late)) == []


def test_a_parked_sequence_stopped_while_waiting_has_its_copies_dropped(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    _, b, _ = _preempted(g)
    out = g.client(p.StopGenerate(id=2), addr=CLIENT_B)
    assert out[:2] == freed(b) and kinds(out[2:]) == [(CLIENT_B, "generated")]
    assert g.core.generation.parked == {}


@pytest.mark.parametrize("answer", ["tokens", "error"])
def test_a_sequence_stopped_as_it_resumes_from_its_parked_kv_is_freed_once_that_is_back(
    lm_dir: Path, files: LmFiles, answer: str
) -> None:
    g = Gen(lm_dir, files)
    a, b, run = _preempted(g)
    _both_parked(g, b)
    run = run_of(_a_ends(g, a, run), g.w0)
    assert steps(run) == [(b, 3, 1, 1)]
    stage1 = g.stage0(run)
    # Stopped while the iteration resuming it is between stages: stage 1 has yet to copy its
    # parked KV back, so nothing is freed now (its answer, whatever it is, frees it).
    assert g.client(p.StopGenerate(id=2), CLIENT_B) == [
        (CLIENT, CLIENT_B, p.Generated(id=2, outputs=[out_of([20], "stop", 3)]))
    ]
    if answer == "tokens":
        assert g.last(stage1, [{"tokens": tokens([21])}]) == freed(b)
    else:
        err = p.Error(id=stage1.id, code=str(Code.MODEL_ERROR), reason="RuntimeError: boom")
        assert g.keep(g.h.backend(g.w1, err)) == freed(b)
    assert g.core.generation.parked == {}
    g.answered_once()


def _park_answers(g: Gen, *seqs: int) -> Out:
    """Each stage's worker says it parked `seqs`' KV (one answer to their one FreeSeqs with
    park); what the last answer lets go out."""
    out: Out = []
    for stage, w in enumerate((g.w0, g.w1)):
        answer = p.SeqsParked(model="lm", stage=stage, parked=list(seqs), dropped=[])
        out += g.keep(g.h.backend(w, answer))
    return out


def _swaps_refused_together(g: Gen) -> tuple[int, int, p.Run]:
    """a, b and c decode in one group; out of memory, c then b are preempted, each stage
    parking their KV; a ends and b and c resume together from their KV, nothing else running
    on the replica, and that iteration is refused: both are parked again (one FreeSeqs with
    park), waiting for those answers. Returns b, c and the refused Run."""
    run = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    ((a, *_),) = steps(run)
    assert g.generate(2, [[1, 6, 7], [1, 8]], max_tokens=4, addr=CLIENT_B) == []
    run = run_of(g.step(run, [10]), g.w0)
    (_, (b, *_), (c, *_)) = steps(run)
    run = run_of(g.step(run, [11, 20, 30]), g.w0)
    assert steps(run) == [(a, 3, 1, 2), (b, 3, 1, 1), (c, 2, 1, 1)]
    out = no_space(g, run, g.w0)
    run = run_of(out, g.w0)
    assert out == [*parked(c), (BACKEND, g.w0, run)] and steps(run) == [(a, 3, 1, 2), (b, 3, 1, 1)]
    out = no_space(g, run, g.w0)
    run = run_of(out, g.w0)
    assert out == [*parked(b), (BACKEND, g.w0, run)] and steps(run) == [(a, 3, 1, 2)]
    assert _park_answers(g, c) == [] and _park_answers(g, b) == []
    out = g.step(run, [12])
    swapped = run_of(out, g.w0)
    assert out == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([10, 11, 12], "length", 2)])),
        (BACKEND, g.w0, swapped),
    ]
    assert steps(swapped) == [(b, 3, 1, 1), (c, 2, 1, 1)] and ids_of(swapped) == [20, 30]
    # Together they do not fit: parked again, nothing sent until their workers answer.
    assert no_space(g, swapped, g.w0) == parked(b, c)
    return b, c, swapped


def test_resumed_sequences_refused_together_rejoin_one_at_a_time(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, gen_groups=1)
    b, c, refused_run = _swaps_refused_together(g)
    # Their workers parked them again: b alone resumes (the verdict on it), not the refused
    # iteration again (that resent at once, answer after answer, was a livelock).
    out = _park_answers(g, b, c)
    run = run_of(out, g.w0)
    assert out == [(BACKEND, g.w0, run)]
    assert steps(run) == [(b, 3, 1, 1)] and steps(run) != steps(refused_run)
    # b is back: c joins it, resumed from its own parked KV.
    run = run_of(g.step(run, [21]), g.w0)
    assert steps(run) == [(b, 4, 1, 2), (c, 2, 1, 1)]
    run = run_of(g.step(run, [22, 31]), g.w0)
    assert steps(run) == [(b, 5, 1, 3), (c, 3, 1, 2)]
    out = g.step(run, [23, 32])
    run = run_of(out, g.w0)
    assert out == [*freed(b), (BACKEND, g.w0, run)] and steps(run) == [(c, 4, 1, 3)]
    assert g.step(run, [33]) == [
        *freed(c),
        (
            CLIENT,
            CLIENT_B,
            p.Generated(
                id=2,
                outputs=[
                    out_of([20, 21, 22, 23], "length", 3),
                    out_of([30, 31, 32, 33], "length", 2),
                ],
            ),
        ),
    ]
    row = g.core.status(g.h.now).models[0]
    assert (row.preemptions, row.swaps, row.recomputes) == (2, 2, 0)
    assert g.core.generation.parked == {}
    g.answered_once()


def test_a_resumed_sequence_refused_alone_beside_another_model_waits_then_goes_alone(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, gen_groups=1)
    _beside_ranker(g)
    b, c, _ = _swaps_refused_together(g)
    run = run_of(_park_answers(g, b, c), g.w0)
    assert steps(run) == [(b, 3, 1, 1)]
    # Alone and refused beside another model's stage: parked again, it waits for room; nothing
    # is sent again before KV_RETRY_S has passed (nothing freed meanwhile) ...
    assert no_space(g, run, g.w0) == parked(b)
    assert _park_answers(g, b) == [] and g.tick(KV_RETRY_S / 2) == []
    # ... and then b alone tries again, not b and c together.
    run = run_of(g.tick(KV_RETRY_S), g.w0)
    assert steps(run) == [(b, 3, 1, 1)]
    run = run_of(g.step(run, [21]), g.w0)
    assert steps(run) == [(b, 4, 1, 2), (c, 2, 1, 1)]
    assert g.core.generation.by_model["lm"].room_wait == ""
    g.client(p.StopGenerate(id=2), CLIENT_B)
    g.step(run, [22, 31])
    g.answered_once()


def test_a_stopped_prefill_out_of_memory_is_no_verdict_on_the_call(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, max_seqs=1)
    run = g.first(g.generate(1, [[1, 5], [1, 6]], max_tokens=2))
    ((a, *_),) = steps(run)
    g.client(p.StopGenerate(id=1, indexes=[0]))
    # The lone prefill in that iteration was stopped: its NO_SPACE says nothing of the
    # call's other sequence, which runs next.
    out = no_space(g, run, g.w0)
    run = run_of(out, g.w0)
    assert out == [*freed(a), (BACKEND, g.w0, run)]
    assert steps(run) == [(a + 1, 0, 2, 0)] and g.told == []


def test_the_door_refuses_a_full_queue_and_a_running_id(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, max_seqs=1, max_queue=2)
    g.first(g.generate(1, [[1, 5]], max_tokens=3))
    err = refused(g, p.Generate(id=1, model="lm", prompts=[[1]]))
    assert (err.code, err.reason) == (Code.BAD_REQUEST, "generate 1 is already running")
    assert g.generate(2, [[1], [1]]) == []
    err = refused(g, p.Generate(id=3, model="lm", prompts=[[1]]))
    assert (err.code, err.reason) == (
        Code.OVERLOADED,
        "'lm' has 2 sequences waiting (limit 2); retry later",
    )
    assert g.figures() == (1, 2, 0, 1)


def test_a_ready_models_files_are_read_ahead_of_its_first_call(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, None)
    g.tick(0.5)
    assert g.core.drain_reads() == [("lm", g.hf)]
    g.tick(1.0)
    assert g.core.drain_reads() == []  # once per deploy
    # A read for a directory the model no longer has is for nobody.
    g.core.files_read("lm", "/elsewhere", files, 1.0)
    assert g.core.models["lm"].lm is None
    assert g.read(files) == [] and g.core.models["lm"].lm is files


def test_decodes_out_of_memory_beside_a_stopped_one_run_again(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run, _ = g.firsts(g.generate(1, [[1, 5], [1, 6], [1, 7], [1, 8]], max_tokens=4))
    (a, *_), (c, *_) = steps(run)  # the first and third prompts share the first group
    run = run_of(g.step(run, [10, 30]), g.w0)
    g.client(p.StopGenerate(id=1, indexes=[2]))
    # c's memory is free once the failed iteration is over: a runs again, nobody fails.
    out = no_space(g, run, g.w0)
    run = run_of(out, g.w0)
    assert out == [*freed(c), (BACKEND, g.w0, run)]
    assert steps(run) == [(a, 2, 1, 1)] and g.finals(1) == []


def test_the_door_refuses_a_client_over_its_limit(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, max_client_inflight=2)
    g.first(g.generate(1, [[1]], max_tokens=2))
    assert only(g.generate(2, [[1]], max_tokens=2), p.Run)  # in the other group
    err = refused(g, p.Generate(id=3, model="lm", prompts=[[1]]))
    assert (err.code, err.reason) == (
        Code.OVERLOADED,
        "this client has 2 requests queued or running (limit 2 per client); wait for answers, "
        "then retry",
    )
    assert g.generate(3, [[1]], max_tokens=2, addr=CLIENT_B) == []  # another client's own


def test_calls_waiting_for_the_files_are_bounded(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, None, max_queue=1)
    assert g.generate(1, [[1]]) == []
    err = refused(g, p.TokenizerInfo(id=2, model="lm"))
    assert (err.code, err.reason) == (
        Code.OVERLOADED,
        "'lm': its files are still being read; retry",
    )


# ====================================================================== the model's files


def write_dir(path: Path, lm_dir: Path, **files: Any) -> Path:
    """A directory with `lm_dir`'s config.json and `files` (name -> JSON, or text)."""
    path.mkdir()
    (path / "config.json").write_text((lm_dir / "config.json").read_text())
    for name, value in files.items():
        text = value if isinstance(value, str) else json.dumps(value)
        (path / name.replace("__", ".")).write_text(text)
    return path


def test_a_directory_without_a_tokenizer_generates_from_ids(tmp_path: Path, lm_dir: Path) -> None:
    # generation_config.json's eos ids win over config.json's (2), as in Hugging Face's generate.
    hf = write_dir(tmp_path / "bare", lm_dir, generation_config__json={"eos_token_id": [2, 7]})
    got = read_lm_files(str(hf))
    assert (got.error, got.tokenizer_json, got.eos_ids, got.bos_id, got.vocab_size) == (
        None,
        None,
        (2, 7),
        1,
        VOCAB,
    )
    g = Gen(hf, got)
    err = refused(g, p.TokenizerInfo(id=1, model="lm"))
    assert (err.code, err.reason) == (
        Code.BAD_REQUEST,
        f"'lm' has no tokenizer in its directory (hf directory {str(hf)!r} has no tokenizer.json: "
        "text needs the model's tokenizer (generation from token ids works without one)); "
        "generate from token ids",
    )
    run = g.first(g.generate(2, [[1, 5]], ignore_eos=False))
    ((a, *_),) = steps(run)
    assert g.step(run, [7]) == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Generated(id=2, outputs=[out_of([7], "stop", 2)])),
    ]
    g.answered_once()


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        ({}, "{hf!r} has no readable config.json"),
        ({"config__json": "{not json"}, "{hf!r} has no readable config.json"),
        ({"config__json": "[1, 2]"}, "{hf!r}: config.json is not a JSON object"),
        (
            {"config__json": {"architectures": "LlamaForCausalLM"}},
            "its config.json names no architecture it supports",
        ),
    ],
)
def test_a_directory_generation_cannot_take_is_refused(
    tmp_path: Path, files: dict[str, Any], reason: str
) -> None:
    hf = tmp_path / "d"
    hf.mkdir()
    for name, value in files.items():
        text = value if isinstance(value, str) else json.dumps(value)
        (hf / name.replace("__", ".")).write_text(text)
    got = read_lm_files(str(hf))
    assert got.error is not None and got.error.code is Code.BAD_REQUEST
    assert got.error.reason.startswith(reason.format(hf=str(hf)) + "; generation takes a model")


def test_a_broken_generation_config_leaves_config_jsons_ids(tmp_path: Path, lm_dir: Path) -> None:
    hf = write_dir(tmp_path / "b", lm_dir, generation_config__json="{oops")
    got = read_lm_files(str(hf))
    assert (got.error, got.eos_ids, got.bos_id, got.max_positions) == (None, (2,), 1, 64)


def test_reads_run_on_a_thread_and_come_back_on_the_loop(lm_dir: Path, files: LmFiles) -> None:
    import asyncio

    from broker.lm_files import start_reads

    g = Gen(lm_dir, None)
    assert g.generate(1, [[1, 5]], max_tokens=1) == []

    async def main() -> Out:
        loop = asyncio.get_running_loop()
        flushed = asyncio.Event()
        start_reads(g.core, loop, lambda: 0.5, flushed.set)
        await asyncio.wait_for(flushed.wait(), 30)
        return g.keep(g.h.out())

    out = asyncio.run(main())
    assert g.core.models["lm"].lm == files
    ((a, *_),) = steps(g.first(out))
    assert g.step(run_of(out, g.w0), [9]) == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([9], "length", 2, 0.0)])),
    ]
    g.answered_once()


def test_a_direct_iteration_is_announced_to_every_stage(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    for i, w in enumerate(("w0", "w1")):
        g.core.peers[w].info.peer_endpoint = f"tcp://127.0.0.1:{7000 + i}"
    out = g.generate(1, [[1, 5, 6]], max_tokens=1)
    assert kinds(out) == [(g.w0, "load"), (g.w1, "load"), (g.w0, "run"), (g.w1, "run")]
    r0, r1 = only(out, p.Run)
    ((a, *_),) = steps(r0)
    # One packed part, never cut in micro-batches; stage 0 alone gets the ids.
    assert (r0.id, r0.gen, r0.chunks, r0.next_peer, ids_of(r0)) == (
        r1.id,
        r1.gen,
        1,
        "tcp://127.0.0.1:7001",
        [1, 5, 6],
    )
    assert (r1.stage, r1.from_peer, r1.tensors, r1.chunks) == (1, True, [], 1)
    assert g.last(r1, [{"tokens": tokens([9])}]) == [
        *freed(a),
        (CLIENT, CLIENT_A, p.Generated(id=1, outputs=[out_of([9], "length", 3)])),
    ]
    g.answered_once()


def test_gpt2s_context_is_its_n_positions(tmp_path: Path) -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "n_positions": 48, "vocab_size": 50}
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": 9}))
    got = read_lm_files(str(tmp_path))
    assert (got.error, got.architecture, got.max_positions, got.vocab_size, got.eos_ids) == (
        None,
        "GPT2LMHeadModel",
        48,
        50,
        (9,),
    )


def test_a_max_context_past_a_learned_table_of_positions_stops_at_the_table(
    tmp_path: Path,
) -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "n_positions": 48, "vocab_size": 50}
    (tmp_path / "config.json").write_text(json.dumps(config))
    g = Gen(tmp_path, read_lm_files(str(tmp_path)), max_context=1024)
    err = refused(
        g, p.Generate(id=3, model="lm", prompts=[[1] * 40], sampling=p.Sampling(max_tokens=9))
    )
    assert (err.code, err.reason) == (
        Code.BAD_REQUEST,
        "prompt 0 has 40 tokens and max_tokens is 9: 49 is over the max_context of 'lm' (48)",
    )
    assert only(g.generate(4, [[1] * 40], max_tokens=8), p.Run)


def test_a_call_waits_for_a_replica_being_repaired(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    w2 = g.h.worker("w2")
    g.h.now = 2.5
    for w in (g.w0, w2, b"part"):
        g.h.backend(w, p.Heartbeat())
    out = g.tick(4.0)  # w1 is lost: the replica is placed again, on w0 and w2
    deploys = only(out, p.DeployStage)
    assert [(m.stage, a) for _, a, m in out if isinstance(m, p.DeployStage)] == [(0, g.w0), (1, w2)]
    assert g.generate(1, [[1, 5]], max_tokens=1) == []  # not refused: it waits
    assert g.figures() == (0, 1, 0, 0)
    out = []
    for m, w in zip(deploys, (g.w0, w2), strict=True):
        ready = p.StageReady(id=m.id, model="lm", stage=m.stage, nbytes=MIB, seconds=0.1)
        out += g.keep(g.h.backend(w, ready))
    run = run_of(out, g.w0)
    ((a, *_),) = steps(run)
    assert steps(run) == [(a, 0, 2, 0)]


def test_a_replica_sharing_a_worker_does_not_generate(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    g.h.now = 2.5
    for w in (g.w0, b"part"):
        g.h.backend(w, p.Heartbeat())
    g.tick(4.0)  # w1 is lost: both stages placed again on w0
    assert [r.workers for r in g.core.models["lm"].replicas] == [["w0", "w0"]]
    err = refused(g, p.Generate(id=1, model="lm", prompts=[[1]]))
    assert (err.code, err.reason) == (
        Code.BAD_REQUEST,
        "'lm' runs streamed (more stages than workers): generation needs each stage on a "
        "worker of its own",
    )


def test_sequences_stay_on_the_replica_they_were_prefilled_on(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files, max_seqs=1, replicas=2)
    one, two = (g.w0, g.w1), (b"w2", b"w3")
    assert [r.workers for r in g.core.models["lm"].replicas] == [["w0", "w1"], ["w2", "w3"]]
    run1 = g.first(g.generate(1, [[1, 5]], max_tokens=3))
    run2 = g.first(g.generate(2, [[1, 6]], max_tokens=2, addr=CLIENT_B), two)
    assert g.generate(3, [[1, 7]], max_tokens=1) == []  # both replicas full (max_seqs 1)
    ((a, *_),) = steps(run1)
    ((b, *_),) = steps(run2)
    run2 = run_of(g.step(run2, [20], two), b"w2")
    assert steps(run2) == [(b, 2, 1, 1)]
    run1 = run_of(g.step(run1, [10], one), g.w0)
    assert steps(run1) == [(a, 2, 1, 1)]
    # b ends: its replica's workers free it, and the waiting call takes its place there.
    out = g.step(run2, [21], two)
    run3 = run_of(out, b"w2")
    ((c, *_),) = steps(run3)
    assert out == [
        (BACKEND, b"w2", p.FreeSeqs(model="lm", stage=0, seqs=[b])),
        (BACKEND, b"w3", p.FreeSeqs(model="lm", stage=1, seqs=[b])),
        (CLIENT, CLIENT_B, p.Generated(id=2, outputs=[out_of([20, 21], "length", 2)])),
        (BACKEND, b"w2", run3),
    ]
    assert steps(run3) == [(c, 0, 2, 0)]
    assert g.step(run3, [30], two)[-1] == (
        CLIENT,
        CLIENT_A,
        p.Generated(id=3, outputs=[out_of([30], "length", 2)]),
    )
    run1 = run_of(g.step(run1, [11], one), g.w0)
    assert steps(run1) == [(a, 3, 1, 2)]
    assert g.step(run1, [12], one)[:2] == freed(a)
    g.answered_once()


def test_a_starving_sequence_whose_only_replica_is_full_waits_for_room(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files, max_seqs=1, starvation_s=0.5)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=2))
    assert g.generate(2, [[1, 6]], max_tokens=1, addr=CLIENT_B) == []
    # Past the starvation limit its model's one replica is still full, in use by a: there is
    # nothing to load or reserve, and it waits (the broker must not fail on it).
    assert g.tick(0.6) == []
    assert g.figures()[:2] == (1, 1)
    run = run_of(g.step(run, [10]), g.w0)
    out = g.step(run, [11])
    assert kinds(out)[-1] == (g.w0, "run")  # a ended: b joins
    assert ids_of(run_of(out, g.w0)) == [1, 6]  # b's prefill
