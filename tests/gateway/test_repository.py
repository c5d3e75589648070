"""The KServe v2 model repository extension through a real gateway with API keys in front of a
real mesh: its index lists the deployed models; `load` deploys from a flowmesh deploy spec and
`unload` undeploys, for operator keys only (a client key is refused with 403 and changes
nothing)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest
import tritonclient.http as triton

from client_sdk.mesh import LocalMesh
from flowmesh.auth import add_api_key
from tests.support.mesh import FAST, roots_at

pytestmark = pytest.mark.slow

SPEC = {"factory": "flowmesh.examples:mlp", "kwargs": {"width": 8, "depth": 2}, "seed": 1}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory,
    start_gateway: Callable[..., AbstractContextManager[str]],
) -> Iterator[tuple[LocalMesh, str, dict[str, str]]]:
    root = tmp_path_factory.mktemp("gateway-repo")
    path, app = add_api_key(root / "api", "app", "client")
    _, ops = add_api_key(root / "api", "ops", "operator")
    with (
        LocalMesh(cpu_workers=1, memory_budget="8MiB", **roots_at(root), **FAST) as mesh,
        start_gateway(mesh.frontend, args=["--api-keys", str(path)]) as url,
    ):
        yield mesh, url, {"client": app, "operator": ops}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_client_key_may_neither_load_nor_unload(
    served: tuple[LocalMesh, str, dict[str, str]],
) -> None:
    mesh, url, keys = served
    for verb in ("load", "unload"):
        answer = httpx.post(
            f"{url}/v2/repository/models/m/{verb}",
            json={"parameters": SPEC},
            headers=bearer(keys["client"]),
            timeout=60,
        )
        assert answer.status_code == 403, answer.text
        assert "operator" in answer.json()["error"]
    with mesh.client() as c:
        assert [m.name for m in c.status().models] == []


def test_an_operator_key_loads_then_unloads(served: tuple[LocalMesh, str, dict[str, str]]) -> None:
    mesh, url, keys = served
    v2 = triton.InferenceServerClient(url.removeprefix("http://"))
    headers = bearer(keys["operator"])
    # tritonclient's load_model sends its `config` as a JSON string in parameters.config.
    v2.load_model("m", headers=headers, config=json.dumps(SPEC))
    assert v2.is_model_ready("m", headers=headers)
    with mesh.client() as c:
        assert [m.name for m in c.status().models] == ["m"]
    index = [{"name": "m", "version": "1", "state": "READY", "reason": ""}]
    assert v2.get_model_repository_index(headers=headers) == index
    ready = httpx.post(
        f"{url}/v2/repository/index", json={"ready": True}, headers=headers, timeout=60
    )
    assert ready.json() == index
    # Loaded again without a spec: already there, nothing to do.
    again = httpx.post(f"{url}/v2/repository/models/m/load", headers=headers, timeout=60)
    assert again.status_code == 200, again.text
    v2.unload_model("m", headers=headers)
    ready = httpx.get(f"{url}/v2/models/m/ready", headers=headers, timeout=60)
    assert ready.status_code == 404, ready.text
    assert not v2.is_model_ready("m", headers=headers)
    assert v2.get_model_repository_index(headers=headers) == []


def test_a_load_without_a_spec_or_with_a_wrong_one_is_a_400(
    served: tuple[LocalMesh, str, dict[str, str]],
) -> None:
    _, url, keys = served
    deep = "[" * 3000 + "]" * 3000  # past the JSON decoder's recursion: a 500 once
    for body in (
        "{}",
        json.dumps({"parameters": {"factory": 3}}),
        json.dumps({"parameters": {"layers": 2}}),
        '{"parameters": {"kwargs": ' + deep + "}}",
        json.dumps({"parameters": {"config": deep}}),
    ):
        answer = httpx.post(
            f"{url}/v2/repository/models/other/load",
            content=body,
            headers=bearer(keys["operator"]),
            timeout=60,
        )
        assert answer.status_code == 400, (body[:60], answer.text)
        assert answer.headers["content-type"] == "application/json"
