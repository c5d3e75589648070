"""The KServe v2 / Open Inference Protocol through a real gateway in front of a real mesh, spoken
by `tritonclient.http`: health and readiness, a model's metadata from its declared inputs, and
infer equal to the SDK's, with JSON tensors and with the binary tensor data extension."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from client_sdk.mesh import LocalMesh
from flowmesh.testing import assert_forward_close
from tests.support.mesh import FAST, roots_at

pytestmark = pytest.mark.slow

WIDTH = 8


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    start_gateway: Callable[..., AbstractContextManager[str]],
) -> Iterator[tuple[LocalMesh, str]]:
    root = tmp_path_factory.mktemp("gateway-v2")
    with LocalMesh(cpu_workers=1, memory_budget="8MiB", **roots_at(root), **FAST) as mesh:
        with mesh.client() as c:
            c.deploy("mlp", "flowmesh.examples:mlp", kwargs={"width": WIDTH, "depth": 2}, seed=3)
        # Started as an operator would: `flowmesh gateway` (test_openai.py's is `python -m`).
        with start_gateway(mesh.frontend, cli=True) as url:
            yield mesh, url


@pytest.fixture(scope="module")
def v2(served: tuple[LocalMesh, str]) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(served[1].removeprefix("http://"))


def test_health_readiness_and_metadata(v2: triton.InferenceServerClient) -> None:
    assert v2.is_server_live() and v2.is_server_ready()
    assert v2.is_model_ready("mlp")
    assert not v2.is_model_ready("nope")
    meta = v2.get_model_metadata("mlp")
    assert meta["name"] == "mlp"
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, WIDTH]}]


def test_without_a_broker_live_but_not_ready(
    start_gateway: Callable[..., AbstractContextManager[str]],
) -> None:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        nobody = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    with start_gateway(nobody) as url:
        v2 = triton.InferenceServerClient(url.removeprefix("http://"))
        assert v2.is_server_live()
        answer = httpx.get(f"{url}/v2/health/ready", timeout=30)
        assert answer.status_code == 503 and answer.json()["ready"] is False


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_equals_the_sdk(
    served: tuple[LocalMesh, str], v2: triton.InferenceServerClient, binary: bool
) -> None:
    mesh, _ = served
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(7))
    with mesh.client() as c:
        expected = c.infer("mlp", x)
    assert isinstance(expected, torch.Tensor)
    given = triton.InferInput("x", [3, WIDTH], "FP32")
    given.set_data_from_numpy(x.numpy(), binary_data=binary)
    asked = triton.InferRequestedOutput("output0", binary_data=binary)
    answer = v2.infer("mlp", [given], outputs=[asked], request_id="r1")
    got = answer.as_numpy("output0")
    assert got is not None and got.dtype == np.float32
    # Two forwards of the same rows (each may be batched with other calls): close, not bits.
    assert_forward_close(torch.from_numpy(got.copy()), expected)
    assert answer.get_response()["id"] == "r1"


def test_refusals_answer_v2_statuses(
    served: tuple[LocalMesh, str], v2: triton.InferenceServerClient
) -> None:
    x = np.zeros((2, WIDTH), dtype=np.float32)
    given = triton.InferInput("x", [2, WIDTH], "FP32")
    given.set_data_from_numpy(x, binary_data=False)
    with pytest.raises(InferenceServerException) as lost:
        v2.infer("nope", [given])
    assert lost.value.status() == "404"
    url = f"{served[1]}/v2/models/mlp/infer"
    # A shape that does not match the data, checked before anything is forwarded.
    short = {"inputs": [{"name": "x", "shape": [2, WIDTH], "datatype": "FP32", "data": [1.0] * 3}]}
    answer = httpx.post(url, json=short, timeout=10)
    assert answer.status_code == 400 and "takes 16" in answer.json()["error"]
    # Floats for an integer tensor, and a datatype v2 has but flowmesh does not carry.
    floats = {"inputs": [{"name": "x", "shape": [1], "datatype": "INT64", "data": [1.5]}]}
    assert httpx.post(url, json=floats, timeout=10).status_code == 400
    text = {"inputs": [{"name": "x", "shape": [1], "datatype": "BYTES", "data": ["a"]}]}
    answer = httpx.post(url, json=text, timeout=10)
    assert answer.status_code == 400 and "BYTES" in answer.json()["error"]
    # The model's own check of its declared inputs (the broker's refusal).
    wide = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [0.0] * 3}]}
    answer = httpx.post(url, json=wide, timeout=10)
    assert answer.status_code == 400, answer.text


def test_a_call_past_the_timeout_answers_504(
    served: tuple[LocalMesh, str], start_gateway: Callable[..., AbstractContextManager[str]]
) -> None:
    # Last in the module: the broker is frozen for a moment. Frozen, it answers nothing, so the
    # gateway's call runs past --timeout whatever the machine's speed.
    mesh, _ = served
    broker = mesh.child("broker").proc
    given = {"inputs": [{"name": "x", "shape": [1, WIDTH], "datatype": "FP32", "data": [0.0] * 8}]}
    with start_gateway(mesh.frontend, args=["--timeout", "1"]) as url:
        assert httpx.post(f"{url}/v2/models/mlp/infer", json=given, timeout=30).status_code == 200
        broker.send_signal(signal.SIGSTOP)
        try:
            answer = httpx.post(f"{url}/v2/models/mlp/infer", json=given, timeout=30)
        finally:
            broker.send_signal(signal.SIGCONT)
    assert answer.status_code == 504 and "within 1.0 s" in answer.json()["error"]
