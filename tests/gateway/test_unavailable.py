"""The mesh's refusals for want of room or of anyone to answer, through a real gateway, in each
protocol's status and error body: a broker's OVERLOADED (its queue full) as 429, no broker as
503, a mesh without a worker live but not ready, and a call past the gateway's --timeout as 504
under /v1 (test_kserve.py has the 504 of a v2 infer)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager

import httpx
import openai
import pytest

from client_sdk.mesh import LocalMesh
from tests.support.lm import tiny_lm_dir
from tests.support.mesh import FAST, roots_at

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def queue_of_one(
    tmp_path_factory: pytest.TempPathFactory,
    start_gateway: Callable[..., AbstractContextManager[str]],
) -> Iterator[tuple[LocalMesh, str]]:
    """A tiny LM behind a broker that queues one sequence per model (`--max-queue 1`), and a
    gateway in front of it that gives each call to the broker 1 s (`--timeout 1`)."""
    root = tmp_path_factory.mktemp("gateway-queue")
    model_dir = tiny_lm_dir(root / "tiny-llama", "llama", seed=5, max_positions=64)
    broker_args = ["--max-queue", "1"]
    with LocalMesh(
        cpu_workers=1, memory_budget="8MiB", broker_args=broker_args, **roots_at(root), **FAST
    ) as mesh:
        with mesh.client() as c:
            c.deploy("lm", hf=str(model_dir), max_seqs=2)
            c.generate("lm", PROMPT, max_tokens=2)  # loaded: later calls wait for no load
        with start_gateway(mesh.frontend, args=["--timeout", "1"]) as url:
            yield mesh, url


def test_a_full_queue_answers_429_in_openais_body(queue_of_one: tuple[LocalMesh, str]) -> None:
    _, url = queue_of_one
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    # Two prompts are two sequences: more than a queue of one takes, whatever else runs.
    with pytest.raises(openai.RateLimitError) as full:
        api.completions.create(model="lm", prompt=[PROMPT, PROMPT], max_tokens=2)
    assert full.value.status_code == 429
    assert full.value.code == "overloaded" and "limit 1" in full.value.message
    assert full.value.type == "rate_limit_error"
    # One prompt is taken.
    assert api.completions.create(model="lm", prompt=PROMPT, max_tokens=2).choices[0].text


def test_a_call_past_the_timeout_answers_504_in_openais_body(
    queue_of_one: tuple[LocalMesh, str],
) -> None:
    # Last in the module: the broker is frozen for a moment, so that the gateway's call runs
    # past its --timeout whatever the machine's speed.
    mesh, url = queue_of_one
    broker = mesh.child("broker").proc
    ask = {"model": "lm", "prompt": PROMPT, "max_tokens": 2}
    broker.send_signal(signal.SIGSTOP)
    try:
        answer = httpx.post(f"{url}/v1/completions", json=ask, timeout=30)
    finally:
        broker.send_signal(signal.SIGCONT)
    assert answer.status_code == 504
    error = answer.json()["error"]
    assert error["code"] == "timeout" and "within 1.0 s" in error["message"]
    assert error["type"] == "server_error"


def test_without_a_broker_calls_answer_503_in_each_protocols_body(
    start_gateway: Callable[..., AbstractContextManager[str]], nobody: str
) -> None:
    with start_gateway(nobody) as url:
        infer = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0, 1]}]}
        complete = {"model": "lm", "prompt": PROMPT, "max_tokens": 2}
        # Together: each waits out the SDK's connect timeout (5 s) for a broker to answer.
        with ThreadPoolExecutor(2) as pool:
            v2 = pool.submit(httpx.post, f"{url}/v2/models/mlp/infer", json=infer, timeout=30)
            v1 = pool.submit(httpx.post, f"{url}/v1/completions", json=complete, timeout=30)
            v2_answer, v1_answer = v2.result(), v1.result()
    assert v2_answer.status_code == 503 and "no broker answers" in v2_answer.json()["error"]
    error = v1_answer.json()["error"]
    assert v1_answer.status_code == 503 and error["code"] == "unavailable"
    assert "no broker answers" in error["message"] and error["type"] == "server_error"


def test_a_mesh_without_a_worker_is_live_but_not_ready(
    tmp_path_factory: pytest.TempPathFactory,
    start_gateway: Callable[..., AbstractContextManager[str]],
) -> None:
    root = tmp_path_factory.mktemp("gateway-no-worker")
    with (
        LocalMesh(cpu_workers=0, partitioner=False, **roots_at(root), **FAST) as mesh,
        start_gateway(mesh.frontend) as url,
    ):
        assert httpx.get(f"{url}/v2/health/live", timeout=30).status_code == 200
        answer = httpx.get(f"{url}/v2/health/ready", timeout=30)
        assert answer.status_code == 503 and answer.json()["ready"] is False
