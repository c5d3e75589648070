"""Ctrl-C on a blocking call stops what the call started on the broker.

A blocking `Client` call runs its coroutine on the client's loop thread (`LoopThread`); the
caller's thread only waits. Ctrl-C (KeyboardInterrupt) ended that wait and reached the caller,
but left the coroutine running on the loop: a `generate` call's sequences went on on the broker,
holding their KV memory, until they ended by themselves; the same call cancelled on an
`AsyncClient`, or a stream closed, stops them at once (README: a cancelled call stops its
sequences on the broker). Now an interrupted wait cancels the coroutine and lets its
cancellation run before the KeyboardInterrupt goes on to the caller.

The first test is `LoopThread`'s own, on a real SIGINT to a child process; the second is the whole
path, in a child process that runs a blocking `Client.generate` on a real mesh and gets a real
SIGINT, as a REPL or a notebook would (it lives on after it), while this test watches the
broker's status.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client_sdk.mesh import LocalMesh
from tests.support.lm import tiny_lm_dir
from tests.support.mesh import FAST, roots_at
from tests.support.waiting import until_blocking

# The interrupted call's tokens: far more than it makes before it is stopped, and more than it
# could make meanwhile if it were not (so that a sequence left running cannot pass for one
# stopped by ending by itself; the test checks the count too).
MAX_TOKENS = 8000


# `LoopThread` on its own, in a child process: a real SIGINT to its main thread while it waits
# for a call's result (in a child, so that a KeyboardInterrupt can never reach pytest itself).
LOOP_CHILD = """
import asyncio, contextlib, signal, sys, threading

from client_sdk.loop_thread import LoopThread
from tests.support.waiting import until_blocking


def waiting_for_a_result(ident):
    frame = sys._current_frames().get(ident)
    return (
        frame is not None
        and frame.f_code.co_name == "wait"
        and frame.f_back is not None
        and frame.f_back.f_code.co_name == "result"
    )


def interrupt(main, started):
    # Once the main thread waits for the call's result. A signal that comes as a thread enters
    # a lock's wait (its last check for signals done, the wait not begun) is seen only when the
    # wait ends by itself: if the main thread is still waiting well after it, it is sent again.
    started.wait(60.0)
    for _ in range(5):
        until_blocking(lambda: waiting_for_a_result(main), "the call's wait", 60.0)
        signal.pthread_kill(main, signal.SIGINT)
        with contextlib.suppress(AssertionError):
            until_blocking(lambda: not waiting_for_a_result(main), "the interrupt", 2.0)
            return


runner, started, ended = LoopThread(), threading.Event(), []


async def call():
    try:
        started.set()
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.sleep(0)  # an end that takes loop turns, as a generate call's does
        ended.append("cancelled")
        raise


threading.Thread(
    target=interrupt, args=(threading.main_thread().ident, started), daemon=True
).start()
try:
    runner.run(call(), 3600.0) if sys.argv[1] == "run" else runner.wait(call())
    print("returned")
except KeyboardInterrupt:
    # Cancelled, and its cancellation had run when the KeyboardInterrupt reached the caller.
    print("interrupted", ended)
runner.stop()
"""


@pytest.mark.parametrize("how", ["run", "wait"])
def test_ctrl_c_on_a_blocking_call_cancels_its_coroutine_and_lets_it_end(how: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", LOOP_CHILD, how],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert (done.returncode, done.stdout) == (0, "interrupted ['cancelled']\n"), done.stderr


CHILD = """
import sys
from client_sdk.client import Client

client = Client(sys.argv[1], timeout=300, keys=False)
print("calling", flush=True)
try:
    client.generate("lm", ids=[1, 5, 6], max_tokens=int(sys.argv[2]), ignore_eos=True)
    print("ended", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.stdin.read()  # lives on after the Ctrl-C, as a REPL does, until the test is done
client.close()
"""


@pytest.fixture(scope="module")
def lm_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    root = tmp_path_factory.mktemp("interrupt")
    model_dir = tiny_lm_dir(root / "tiny-llama", "llama", seed=5, max_positions=MAX_TOKENS + 64)
    with LocalMesh(cpu_workers=1, memory_budget="24MiB", **roots_at(root), **FAST) as mesh:
        with mesh.client() as c:
            c.deploy("lm", hf=str(model_dir), stages=1, max_context=MAX_TOKENS + 64)
        yield mesh


def lm_row(mesh: LocalMesh) -> Any:
    with mesh.client(timeout=10.0) as c:
        (row,) = [m for m in c.status().models if m.name == "lm"]
        return row


def test_ctrl_c_on_a_blocking_generate_stops_its_sequence_on_the_broker(
    lm_mesh: LocalMesh,
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, lm_mesh.frontend, str(MAX_TOKENS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        before = lm_row(lm_mesh).tokens_generated
        until_blocking(
            lambda: lm_row(lm_mesh).running_seqs == 1, "the child's sequence to run", 60.0, 0.05
        )
        child.send_signal(signal.SIGINT)
        assert child.stdout is not None
        # The KeyboardInterrupt reached the child's caller (and the child lives on).
        assert child.stdout.readline() == "calling\n"
        assert child.stdout.readline() == "interrupted\n"
        until_blocking(
            lambda: lm_row(lm_mesh).running_seqs == 0, "the sequence to be stopped", 20.0, 0.05
        )
        row = lm_row(lm_mesh)
        assert row.waiting_seqs == 0
        # Stopped by the Ctrl-C, not ended by itself.
        assert row.tokens_generated - before < MAX_TOKENS, row
        assert child.poll() is None
    finally:
        try:
            _, err = child.communicate("", timeout=30.0)  # its stdin closed: it ends
        except subprocess.TimeoutExpired:
            child.kill()
            _, err = child.communicate()
    assert child.returncode == 0, err
