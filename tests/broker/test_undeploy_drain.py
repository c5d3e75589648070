"""An undeploy of a language model with running generations, in process (`Gen`: two stages on
fake workers, a fake clock): it waits for them to end, refusing new calls, then goes; a drain
that runs out cuts what still runs; `drain_s=0` goes at once. Every message out is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.core import BACKEND, CLIENT
from broker.lm_files import LmFiles, read_lm_files
from flowmesh import protocol as p
from flowmesh.errors import Code
from tests.support.broker import CLIENT_A, CLIENT_B
from tests.support.generation import Gen, freed, out_of, refused, run_of, steps
from tests.support.lm import tiny_lm_dir


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_lm_dir(tmp_path_factory.mktemp("drain") / "tiny", layers=1, hidden=8)


@pytest.fixture(scope="module")
def files(lm_dir: Path) -> LmFiles:
    return read_lm_files(str(lm_dir))


def drops(out: list[tuple[str, bytes, p.Message]]) -> list[tuple[bytes, int]]:
    """The stages workers were told to drop, by worker."""
    return [(a, m.stage) for d, a, m in out if d == BACKEND and isinstance(m, p.DropStage)]


def to_clients(out: list[tuple[str, bytes, p.Message]]) -> list[tuple[bytes, p.Message]]:
    return [(a, m) for d, a, m in out if d == CLIENT]


def test_an_undeploy_waits_for_running_generations_and_refuses_new_calls(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=2))
    ((a, *_),) = steps(run)
    g.h.now = 0.25
    # The broker's default drain (30 s): nothing is answered or dropped yet.
    assert g.client(p.Undeploy(id=8, model="lm"), CLIENT_B) == []
    (row,) = g.core.status(g.h.now).models
    assert row.state == "draining"
    err = refused(g, p.Generate(id=9, model="lm", prompts=[[1, 2]]))
    assert (err.code, err.reason) == (
        Code.MODEL_NOT_FOUND,
        "'lm' is being undeployed (waiting for its running generations to end); it takes no "
        "new calls",
    )
    err = refused(g, p.Deploy(id=10, spec={"name": "lm", "hf": str(lm_dir), "stages": 2}))
    assert err.code == Code.MODEL_EXISTS and "is being undeployed" in err.reason
    # A tick before the end changes nothing; the running call goes on to its end.
    assert to_clients(g.tick(1.0)) == []
    run = run_of(g.step(run, [10]), g.w0)
    g.h.now = 2.0
    out = g.step(run, [11])
    assert to_clients(out) == [
        (CLIENT_A, p.Generated(id=1, outputs=[out_of([10, 11], "length", 2, 1000.0, [1000.0])])),
        (CLIENT_B, p.Undeployed(id=8, model="lm", drained=1, cut=0, waited_s=1.75)),
    ]
    assert out[:2] == freed(a)
    assert drops(out) == [(g.w0, 0), (g.w1, 1)]
    assert "lm" not in g.core.models
    g.answered_once()


def test_a_drain_that_runs_out_cuts_what_still_runs(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    run = g.first(g.generate(1, [[1, 5]], max_tokens=8))
    run_of(g.step(run, [10]), g.w0)
    assert g.client(p.Undeploy(id=8, model="lm", drain_s=1.5), CLIENT_B) == []
    assert to_clients(g.tick(1.0)) == []
    out = g.tick(1.5)
    assert to_clients(out) == [
        (CLIENT_B, p.Undeployed(id=8, model="lm", drained=0, cut=1, waited_s=1.5)),
        (
            CLIENT_A,
            p.Error(
                id=1,
                code=str(Code.MODEL_NOT_FOUND),
                reason="'lm' was undeployed after waiting 1.5 s for its generations to end",
            ),
        ),
    ]
    assert drops(out) == [(g.w0, 0), (g.w1, 1)]
    g.answered_once()


def test_an_undeploy_at_once_during_a_drain_ends_it_and_answers_both(
    lm_dir: Path, files: LmFiles
) -> None:
    g = Gen(lm_dir, files)
    g.first(g.generate(1, [[1, 5]], max_tokens=8))
    assert g.client(p.Undeploy(id=8, model="lm"), CLIENT_B) == []
    g.h.now = 2.0
    out = g.client(p.Undeploy(id=9, model="lm", drain_s=0), CLIENT_B)
    undeployed = p.Undeployed(id=8, model="lm", drained=0, cut=1, waited_s=2.0)
    assert to_clients(out) == [
        (CLIENT_B, undeployed),
        (CLIENT_B, p.Undeployed(id=9, model="lm", drained=0, cut=1, waited_s=2.0)),
        (
            CLIENT_A,
            p.Error(
                id=1,
                code=str(Code.MODEL_NOT_FOUND),
                reason="'lm' was undeployed after waiting 2.0 s for its generations to end",
            ),
        ),
    ]
    g.answered_once()


def test_an_undeploy_with_no_generation_running_goes_at_once(lm_dir: Path, files: LmFiles) -> None:
    g = Gen(lm_dir, files)
    out = g.client(p.Undeploy(id=8, model="lm"), CLIENT_B)
    assert to_clients(out) == [(CLIENT_B, p.Undeployed(id=8, model="lm"))]
    assert drops(out) == [(g.w0, 0), (g.w1, 1)]
    err = refused(g, p.Undeploy(id=9, model="lm"))
    assert (err.code, err.reason) == (Code.MODEL_NOT_FOUND, "no model 'lm'")
