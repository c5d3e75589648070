"""The gateway's door without a mesh behind it (every answer here is the gateway's own, before
the broker is asked): API keys written by `flowmesh keys add --api`, loopback callers only
without keys unless `--insecure-open`, no non-loopback bind without keys, bodies over
`--max-body` refused with 413 and headers over `--max-header` with 431. Keys with a mesh, stream
limits and metrics: test_openai.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import openai
import pytest
import tritonclient.http as triton
from fastapi.testclient import TestClient
from tritonclient.utils import InferenceServerException

from client_sdk import cli
from flowmesh.auth import api_key_hash, read_api_keys
from gateway.app import create_app

ROOT = Path(__file__).resolve().parents[2]
# A body the gateway refuses itself (no inputs), so an answer of 400 means "let in".
NO_INPUTS = {"inputs": []}


def test_keys_add_api_prints_the_key_once_and_stores_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    assert cli.main(["keys", "add", "app", "--role", "client", "--api", "--dir", str(keys)]) == 0
    secret = capsys.readouterr().out.strip()
    assert cli.main(["keys", "add", "ops", "--role", "operator", "--api", "--dir", str(keys)]) == 0
    other = capsys.readouterr().out.strip()
    text = (keys / "api_keys.json").read_text()
    assert secret not in text and other not in text  # only hashes are kept
    known = read_api_keys(keys / "api_keys.json")
    assert {(i.name, i.role) for i in known.values()} == {("app", "client"), ("ops", "operator")}
    assert known[api_key_hash(secret)].name == "app"
    # A name given twice, and a role that is not a caller's, are refused.
    assert cli.main(["keys", "add", "app", "--role", "client", "--api", "--dir", str(keys)]) != 0
    assert cli.main(["keys", "add", "w", "--role", "worker", "--api", "--dir", str(keys)]) != 0
    assert len(read_api_keys(keys / "api_keys.json")) == 2


def test_without_keys_only_loopback_callers_unless_insecure_open(nobody: str) -> None:
    # In process, where the caller's address is Starlette's test client's ("testclient"):
    # the one way to be a non-loopback caller of a gateway that binds loopback only.
    shut = TestClient(create_app(nobody))
    refused = shut.post("/v2/models/m/infer", json=NO_INPUTS)
    assert refused.status_code == 403 and "loopback" in refused.json()["error"]
    assert shut.get("/v1/models").json()["error"]["type"] == "permission_error"
    assert shut.get("/v2/health/live").status_code == 200  # probes stay open
    open_ = TestClient(create_app(nobody, insecure_open=True))
    assert open_.post("/v2/models/m/infer", json=NO_INPUTS).status_code == 400


def test_a_non_loopback_bind_without_keys_refuses_to_start(nobody: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "--broker", nobody, "--host", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "refusing to bind 0.0.0.0 without API keys" in done.stderr
    assert "--insecure-open" in done.stderr


@pytest.fixture(scope="module")
def small(nobody: str, start_gateway: Callable[..., AbstractContextManager[str]]) -> Iterator[str]:
    args = ["--max-body", "1KiB", "--max-header", "2KiB", "--body-timeout", "1"]
    with start_gateway(nobody, args=args) as url:
        yield url


def test_a_body_over_max_body_is_refused_with_413(small: str) -> None:
    url = f"{small}/v2/models/m/infer"
    big = json.dumps({"inputs": [], "pad": "x" * 2048}).encode()
    answer = httpx.post(url, content=big, timeout=30)
    assert answer.status_code == 413 and "1024 bytes" in answer.json()["error"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        yield big[:512]
        yield big[512:]

    answer = httpx.post(url, content=chunks(), timeout=30)
    assert answer.status_code == 413
    # Refused from the header alone: the answer comes with none of the body sent.
    host, port = small.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /v2/models/m/infer HTTP/1.1\r\nHost: {host}\r\n"
            "Content-Length: 100000\r\n\r\n".encode()
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 413")
    assert httpx.post(url, json=NO_INPUTS, timeout=30).status_code == 400  # under: let in
    opened = httpx.post(f"{small}/v1/completions", content=big, timeout=30)
    assert opened.status_code == 413 and opened.json()["error"]["code"] == "too_large"


@pytest.mark.parametrize("path", ["/v2/models/m/infer", "/v1/completions"])
def test_a_body_that_does_not_arrive_in_time_is_answered_408(small: str, path: str) -> None:
    host, port = small.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n{\"inputs\": ".encode()
        )  # then nothing: 90 bytes still owed
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    if path.startswith("/v1"):  # OpenAI's body
        assert error["code"] == "timeout" and "--body-timeout" in error["message"]
    else:
        assert "did not arrive within 1 s" in error
    # A body that comes whole is let in (400: the gateway's own refusal of no inputs).
    assert httpx.post(f"{small}/v2/models/m/infer", json=NO_INPUTS, timeout=30).status_code == 400


def test_headers_over_max_header_are_refused_with_431(small: str) -> None:
    big = {"X-Padding": "x" * 2100}
    answer = httpx.get(f"{small}/v2/health/live", headers=big, timeout=30)
    assert answer.status_code == 431 and "2048 bytes" in answer.json()["error"]
    chat = httpx.post(f"{small}/v1/chat/completions", headers=big, json={}, timeout=30)
    assert chat.status_code == 431 and chat.json()["error"]["code"] == "too_large"
    fine = httpx.get(f"{small}/v2/health/live", headers={"X-Padding": "x" * 1500}, timeout=30)
    assert fine.status_code == 200


def _answer_to(url: str, sent: bytes, more: Iterable[bytes] = ()) -> bytes:
    """What the gateway at `url` answers a raw connection that sends `sent`, then each of
    `more` for as long as the gateway reads, until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(sent)
        try:
            for chunk in more:
                sock.sendall(chunk)
        except OSError:  # the gateway closed the connection while sent to: its answer is read
            pass
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    return answer


def test_a_head_that_does_not_end_is_refused_with_431_as_it_comes(small: str) -> None:
    # One header that never ends (a parser buffering it for as long as it comes would hold
    # the 4 MiB, and read on): the bound is the headers' 2 KiB and the request line's 8 KiB.
    never_ends = (b"y" * 65536 for _ in range(64))
    answer = _answer_to(small, b"GET /v2/health/live HTTP/1.1\r\nX-Padding: ", never_ends)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"connection: close" in answer.lower()
    # A request line as long: the same.
    answer = _answer_to(small, b"GET /v2/health/live?" + b"q" * 12000)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    # A head under the bound that comes in many small pieces is let in.
    head = b"GET /v2/health/live HTTP/1.1\r\nConnection: close\r\nX-Padding: " + b"z" * 1500
    pieces = (head[i : i + 100] for i in range(100, len(head), 100))
    answer = _answer_to(small, head[:100], [*pieces, b"\r\n\r\n"])
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


@pytest.mark.parametrize("sent", [b"", b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n"])
def test_a_head_that_does_not_arrive_in_time_is_answered_408(small: str, sent: bytes) -> None:
    # Nothing at all, or a head with no end: the connection is answered and closed past
    # --body-timeout, not held (uvicorn's own timer runs only between requests).
    answer = _answer_to(small, sent)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    # On a kept-alive connection, the next request's head is timed from its first byte.
    host, port = small.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b"}"):  # the whole answer, its JSON body last
            first += sock.recv(4096)
        assert first.startswith(b"HTTP/1.1 200"), first
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_unknown_paths_and_methods_answer_in_each_protocols_body(small: str) -> None:
    # Starlette's own 404 and 405, answered by the gateway itself (no broker behind this one):
    # in OpenAI's body under /v1, KServe's under /v2, not FastAPI's {"detail": ...}.
    api = openai.OpenAI(base_url=f"{small}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as lost:
        api.embeddings.create(model="lm", input="hi")  # a route flowmesh does not serve
    assert lost.value.type == "invalid_request_error" and lost.value.code == "not_found"
    assert "Not Found: POST /v1/embeddings" in lost.value.message
    v2 = triton.InferenceServerClient(small.removeprefix("http://"))
    with pytest.raises(InferenceServerException) as absent:
        v2.get_model_config("m")  # nor this one
    assert absent.value.status() == "404"
    assert absent.value.message() == "Not Found: GET /v2/models/m/config"
    # A route asked with a method it does not take: 405, its Allow header kept.
    for path in ("/v1/completions", "/v2/models/m/infer"):
        answer = httpx.get(f"{small}{path}", timeout=30)
        assert answer.status_code == 405 and answer.headers["allow"] == "POST"
        error = answer.json()["error"]
        if path.startswith("/v1"):
            assert error["type"] == "invalid_request_error" and error["code"] == "not_allowed"
        else:
            assert error == f"Method Not Allowed: GET {path}"
    # Outside both protocols' paths, FastAPI's own answer is left as it was.
    assert httpx.get(f"{small}/nowhere", timeout=30).json() == {"detail": "Not Found"}
