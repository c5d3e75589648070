"""The KServe v2 / Open Inference Protocol through a real gateway in front of a real mesh, spoken
by `tritonclient.http`: the server's metadata, health and readiness, a model's metadata from its
declared inputs, and infer equal to the SDK's, with JSON tensors and with the binary tensor data
extension; each model route under the model's one version too."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

import flowmesh
from client_sdk.mesh import LocalMesh
from flowmesh.auth import add_api_key
from flowmesh.testing import assert_forward_close
from gateway import kserve
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
    assert v2.get_server_metadata() == {
        "name": "flowmesh",
        "version": flowmesh.__version__,
        "extensions": ["binary_tensor_data", "model_repository"],
    }
    assert v2.is_server_live() and v2.is_server_ready()
    assert v2.is_model_ready("mlp")
    assert not v2.is_model_ready("nope")
    meta = v2.get_model_metadata("mlp")
    assert meta["name"] == "mlp" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, WIDTH]}]
    # The version the metadata names is the model; any other is none of its.
    assert v2.is_model_ready("mlp", model_version="1")
    assert v2.get_model_metadata("mlp", model_version="1") == meta
    assert not v2.is_model_ready("mlp", model_version="2")
    with pytest.raises(InferenceServerException) as lost:
        v2.get_model_metadata("mlp", model_version="2")
    assert lost.value.status() == "404" and "version '2'" in lost.value.message()


def test_without_a_broker_live_but_not_ready(
    start_gateway: Callable[..., AbstractContextManager[str]], nobody: str
) -> None:
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
    # Its version named: the same model; another version, none.
    versioned = v2.infer("mlp", [given], model_version="1", outputs=[asked])
    assert versioned.get_response()["model_version"] == "1"
    assert_forward_close(torch.from_numpy(versioned.as_numpy("output0").copy()), expected)
    with pytest.raises(InferenceServerException) as lost:
        v2.infer("mlp", [given], model_version="2")
    assert lost.value.status() == "404" and "version '2'" in lost.value.message()


def test_the_versioned_infer_route_is_served_by_the_door_as_the_plain_one() -> None:
    """Both infer routes take the guard's fast path (`FastInfer`), past the app's layers."""
    matched = {
        path: [route.match({"method": "POST", "path": path}) for route in kserve.fast_routes()]
        for path in ("/v2/models/mlp/infer", "/v2/models/mlp/versions/1/infer")
    }
    assert matched == {
        "/v2/models/mlp/infer": [{"model": "mlp"}, None],  # matched at the first try
        "/v2/models/mlp/versions/1/infer": [None, {"model": "mlp", "version": "1"}],
    }


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


@pytest.fixture(scope="module")
def keyed(
    served: tuple[LocalMesh, str],
    tmp_path_factory: pytest.TempPathFactory,
    start_gateway: Callable[..., AbstractContextManager[str]],
) -> Iterator[tuple[str, str]]:
    """A second gateway in front of the same mesh, with an API key and a small body limit:
    (url, key)."""
    keys = tmp_path_factory.mktemp("api-keys")
    _, key = add_api_key(keys, "app", "client")
    args = ["--api-keys", str(keys / "api_keys.json"), "--max-body", "2KiB"]
    with start_gateway(served[0].frontend, args=args) as url:
        yield url, key


def _infer_counts(url: str) -> dict[tuple[str, str], float]:
    """The infer route's answers by (status, model), from the gateway's /metrics."""
    counts = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name.endswith("_requests_total") and "infer" in labels.get("route", ""):
                assert labels["route"] == "/v2/models/{model}/infer"
                counts[labels["status"], labels["model"]] = sample.value
    return counts


def test_infer_refusals_at_the_door_and_in_the_body(
    served: tuple[LocalMesh, str], keyed: tuple[str, str]
) -> None:
    """The infer route as the guard serves it once it let a request in (no app layers): the
    door's refusals still come first, and its own in the v2 error body, each counted."""
    url, key = keyed
    infer = f"{url}/v2/models/mlp/infer"
    auth = {"Authorization": f"Bearer {key}"}
    x = [0.5] * WIDTH
    good = {"inputs": [{"name": "x", "shape": [1, WIDTH], "datatype": "FP32", "data": x}]}
    bare = httpx.post(infer, json=good, timeout=30)
    assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
    assert "API key is needed" in bare.json()["error"]
    wrong = httpx.post(infer, json=good, headers={"Authorization": f"Bearer {key}x"}, timeout=30)
    assert wrong.status_code == 401 and "not known" in wrong.json()["error"]
    big = httpx.post(infer, json={**good, "pad": "x" * 3000}, headers=auth, timeout=30)
    assert big.status_code == 413 and "2048 bytes" in big.json()["error"]
    # Let in, refused for its body: not JSON, no inputs, data short of the shape, a header
    # length past the body, bytes left after the binary inputs.
    head = json.dumps(good).encode()
    given = good["inputs"][0]

    def body(**fields: object) -> bytes:
        return json.dumps({**good, **fields}).encode()

    def binary(shape: list[int], data: bytes) -> tuple[bytes, dict[str, str]]:
        item = {**given, "shape": shape, "parameters": {"binary_data_size": len(data)}}
        item.pop("data")
        meta = json.dumps({"inputs": [item]}).encode()
        return meta + data, {"Inference-Header-Content-Length": str(len(meta))}

    cases = [
        (b"{not json", {}, "not JSON"),
        (b'{"inputs": {}}', {}, "non-empty list of inputs"),
        (json.dumps({"inputs": [{**good["inputs"][0], "data": x[:3]}]}).encode(), {}, "takes 8"),
        (head, {"Inference-Header-Content-Length": "99999"}, "within the body"),
        (head + b"\0" * 4, {"Inference-Header-Content-Length": str(len(head))}, "after"),
        # Each of these was a 500 in text/plain (an exception other than FlowmeshError), and
        # the last two only after the model had run; or, in binary, forwarded to the mesh.
        (body(inputs=[{**given, "parameters": [1]}]), {}, "parameters must be an object"),
        # '²' is a digit to str.isdigit, not to int (the header read as latin-1).
        (head, {"Inference-Header-Content-Length": b"\xb2"}, "within the body"),
        (body(inputs=[{**given, "shape": [0, 2**64], "data": []}]), {}, "spans over"),
        (body(inputs=[{**given, "shape": [1] * 65, "data": [0.5]}]), {}, "65 dimensions"),
        (*binary([0, 2**62], b""), "spans over"),
        (*binary([1] * 100, b"\0" * 4), "100 dimensions"),
        (body(parameters=[1]), {}, "parameters must be an object"),
        (body(outputs=5), {}, "outputs must be a list"),
        (body(outputs=[{"name": "output0", "parameters": {"binary_data": "yes"}}]), {}, "true"),
        # Nested past the JSON decoder's recursion: a 500 once (RecursionError), 2 KB of it.
        (b'{"inputs": ' + b"[" * 1000 + b"]" * 1000 + b"}", {}, "nested too deeply"),
    ]
    with served[0].client() as c:
        before = next(m for m in c.status().models if m.name == "mlp")
    for content, headers, why in cases:
        answer = httpx.post(infer, content=content, headers={**auth, **headers}, timeout=30)
        assert answer.status_code == 400 and why in answer.json()["error"], answer.text
        assert answer.headers["content-type"] == "application/json"
    with served[0].client() as c:
        after = next(m for m in c.status().models if m.name == "mlp")
    # Every refusal came before the infer was forwarded: the model saw none of them.
    assert (after.requests, after.refused) == (before.requests, before.refused)
    unknown = httpx.post(f"{url}/v2/models/nope/infer", json=good, headers=auth, timeout=30)
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
    # And let in with a good body: the SDK's answer, in the v2 body.
    with served[0].client() as c:
        expected = c.infer("mlp", torch.tensor([x]))
    assert isinstance(expected, torch.Tensor)
    answer = httpx.post(infer, json={**good, "id": "q"}, headers=auth, timeout=30)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    reply = answer.json()
    assert reply["id"] == "q" and reply["model_name"] == "mlp"
    (out,) = reply["outputs"]
    assert out["name"] == "output0" and out["shape"] == [1, WIDTH]
    assert_forward_close(torch.tensor(out["data"]).reshape(1, WIDTH), expected)
    counts = _infer_counts(url)
    # A model label only on a success: refused at the door, or for its body before the mesh
    # saw it, the name in the path could be anything.
    assert counts[("401", "")] == 2 and counts[("413", "")] == 1
    assert counts[("400", "")] == len(cases) and counts[("200", "mlp")] >= 1
    assert counts[("404", "")] == 1 and counts[("200", "mlp")] == 1


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
