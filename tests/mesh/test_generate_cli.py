"""`flowmesh generate` and the generation flags of `flowmesh deploy`, as a user runs them against
a real mesh, its text the SDK's for the same request. The streamed text runs the command as a
process of its own (what reaches a terminal, flushed as it comes); the other cases call the same
entry point in this process (`client_sdk.cli.main`, its output captured), which spares each a
Python start and a torch import."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from client_sdk.cli import main
from client_sdk.errors import ModelNotFound
from client_sdk.mesh import LocalMesh
from flowmesh.modelio.tokenizer import TextCodec, read_tokenizer
from tests.support.cli import flowmesh
from tests.support.lm import tiny_lm_dir
from tests.support.mesh import FAST, roots_at

PROMPT = "The quick brown fox"


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> Ran:
    """`flowmesh ARGS...` through its entry point, in this process."""
    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return Ran(code, out.out, out.err)


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[LocalMesh, Path]:
    root = tmp_path_factory.mktemp("gen-cli")
    model_dir = tiny_lm_dir(root / "tiny-llama", "llama", seed=5, max_positions=64)
    with LocalMesh(cpu_workers=2, memory_budget="8MiB", **roots_at(root), **FAST) as mesh:
        # The model the tests generate from (each test stands alone: any may run first).
        with mesh.client(timeout=120) as c:
            c.deploy("lm", hf=str(model_dir), stages=2, replicas=1, max_seqs=4)
        yield mesh, model_dir


def test_deploy_flags_reach_the_spec(
    lm: tuple[LocalMesh, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    mesh, model_dir = lm
    base = ["deploy", "lm-flags", "--hf", str(model_dir), "--stages", "2", "--replicas", "1"]
    base += ["--no-progress", "--broker", mesh.frontend]
    # Out of range, each refused by the broker's check of the spec: the flag got there.
    for flag, value, named in [("--max-seqs", "0", "max_seqs"), ("--kv-share", "1.5", "kv_share")]:
        refused = cli(capsys, *base, flag, value)
        assert refused.returncode == 1 and named in refused.stderr, refused.stderr
    done = cli(capsys, *base, "--max-seqs", "4", "--kv-share", "0.5", "--max-context", "48")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deployed lm-flags: "), done.stdout
    # The deployed context is 48, not the config's 64: 30 + 20 is past it.
    past = cli(
        capsys, "generate", "lm-flags", "--ids", ",".join(["3"] * 30), "--max-tokens", "20",
        "--broker", mesh.frontend,
    )  # fmt: skip
    assert past.returncode == 1 and "max_context" in past.stderr and "(48)" in past.stderr
    assert past.stdout == ""


def test_generate_prints_the_sdks_text_then_a_summary(lm: tuple[LocalMesh, Path]) -> None:
    mesh, _ = lm
    with mesh.client() as c:
        want = c.generate("lm", PROMPT, max_tokens=10, ignore_eos=True)
    run = flowmesh(
        "generate", "lm", PROMPT, "--max-tokens", "10", "--ignore-eos",
        "--broker", mesh.frontend,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert want.text and run.stdout == want.text + "\n"
    summary = run.stderr.strip().splitlines()[-1]
    assert summary.startswith("finish: length, 10 token(s) after a prompt of "), run.stderr
    assert "first token" in summary and "tokens/s" in summary


def test_generate_json_from_ids_and_from_a_chat(
    lm: tuple[LocalMesh, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    mesh, model_dir = lm
    codec = TextCodec.from_files(read_tokenizer(model_dir))
    ids = codec.encode(PROMPT)
    chat = [{"role": "user", "content": PROMPT}]
    with mesh.client() as c:
        want = c.generate("lm", ids=ids, max_tokens=6, ignore_eos=True)
        want_chat = c.generate("lm", messages=chat, max_tokens=6, ignore_eos=True)
    run = cli(
        capsys, "generate", "lm", "--ids", ",".join(map(str, ids)), "--max-tokens", "6",
        "--ignore-eos", "--json", "--broker", mesh.frontend,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["ids"] == want.ids and got["text"] == want.text
    assert got["finish_reason"] == "length" and got["prompt_tokens"] == len(ids)
    chatted = cli(
        capsys, "generate", "lm", PROMPT, "--chat", "--max-tokens", "6", "--ignore-eos", "--json",
        "--broker", mesh.frontend,
    )  # fmt: skip
    assert chatted.returncode == 0, chatted.stderr
    assert json.loads(chatted.stdout)["ids"] == want_chat.ids


def test_generate_from_an_unknown_model_fails_on_stderr(
    lm: tuple[LocalMesh, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    mesh, _ = lm
    run = cli(capsys, "generate", "nope", "hi", "--broker", mesh.frontend)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith("flowmesh generate: [model_not_found]"), run.stderr


def test_undeploy_drain_cuts_a_running_generation_and_says_so(
    lm: tuple[LocalMesh, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`flowmesh undeploy --drain 0` under a running stream: the stream fails at once,
    and the command says that one generation was cut."""
    mesh, short = lm
    # A long context: the generation must still be running when its worker is stopped, and a
    # test process put aside for a while on a busy machine must not see 48 tokens end first.
    # (Beside the other model: under the mesh's data root.)
    model_dir = tiny_lm_dir(short.parent / "tiny-llama-long", "llama", seed=5, max_positions=1024)
    with mesh.client() as c:
        c.deploy("lm-cut", hf=str(model_dir), stages=1, replicas=1, max_seqs=1)
        (row,) = [m for m in c.status().models if m.name == "lm-cut"]
        worker = mesh.child(row.replicas[0].workers[0]).proc
        with c.generate_stream("lm-cut", PROMPT, max_tokens=1000, ignore_eos=True) as stream:
            next(iter(stream))  # the first token: the rest are still to come
            # Its worker held still meanwhile (well within its heartbeats' grace), so that the
            # generation is surely still running when the undeploy comes, however fast it is.
            worker.send_signal(signal.SIGSTOP)
            try:
                run = cli(capsys, "undeploy", "lm-cut", "--drain", "0", "--broker", mesh.frontend)
            finally:
                worker.send_signal(signal.SIGCONT)
            assert run.returncode == 0, run.stderr
            assert run.stdout.startswith("undeployed lm-cut after "), run.stdout
            assert run.stdout.endswith(": 0 generation(s) ended meanwhile, 1 cut\n"), run.stdout
            with pytest.raises(ModelNotFound, match="'lm-cut' was undeployed"):
                list(stream)
