"""One allow-list, set once on the broker: the partitioner and workers apply what they receive at
registration, may narrow it and never widen it, and a refusal names the process that refused and
the list it applied. The model is a user's own factory module outside the repository."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from client_sdk.mesh import LocalMesh
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.spec import ModelSpec, narrow_allow
from flowmesh.testing import assert_forward_close
from partitioner.service import plan_for
from tests.support.mesh import FAST

USER_MODULE = '''
import torch
from torch import nn


def stack(width: int = 64, depth: int = 12) -> nn.Module:
    """Sequential(Linear, GELU) x depth: a user's own model, no head."""
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers)
    model.flowmesh_inputs = {"x": {"dtype": "float32", "shape": [-1, width]}}
    return model
'''


@pytest.fixture
def user_module(tmp_path: Path) -> str:
    (tmp_path / "my_zoo.py").write_text(USER_MODULE)
    sys.path.insert(0, str(tmp_path))
    yield str(tmp_path)
    sys.path.remove(str(tmp_path))
    sys.modules.pop("my_zoo", None)


def env_with(path: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([path, os.getcwd(), os.environ.get("PYTHONPATH", "")])}


def reference(width: int, depth: int, seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return importlib.import_module("my_zoo").stack(width, depth).eval()


def test_narrowing_never_widens() -> None:
    assert narrow_allow(("a", "b.c"), None) == ("a", "b.c")
    assert narrow_allow(("a", "b.c"), ("a",)) == ("a",)
    assert narrow_allow(("a",), ("a.x", "z")) == ("a.x",)  # narrower than the mesh's
    assert narrow_allow(("a",), ("b",)) == ()  # nothing the broker does not allow
    assert narrow_allow(("b.c",), ("b",)) == ("b.c",)  # not widened to all of b


def test_the_partitioner_names_itself_when_it_refuses() -> None:
    request = p.PlanAsk(spec=ModelSpec(name="m", factory="my_zoo:stack", seed=0), kind="stages")
    with pytest.raises(FlowmeshError) as err:
        plan_for(request, ("flowmesh.examples",), None, "partitioner p-1")
    assert err.value.code == Code.NOT_ALLOWED
    assert "partitioner p-1 refused factory 'my_zoo:stack'" in err.value.reason
    assert "(flowmesh.examples)" in err.value.reason


def test_the_broker_list_reaches_the_partitioner_and_workers(user_module: str) -> None:
    with (
        LocalMesh(
            cpu_workers=2,
            memory_budget="8MiB",
            allow=["flowmesh.examples", "my_zoo"],  # the broker's flag only
            env=env_with(user_module),
            **FAST,
        ) as mesh,
        mesh.client(timeout=120) as c,
    ):
        c.deploy("mine", "my_zoo:stack", kwargs={"width": 64, "depth": 12}, seed=5, stages=2)
        x = torch.randn(3, 64)
        out = c.infer("mine", x)
        with torch.inference_mode():
            assert_forward_close(out, reference(64, 12, 5)(x))
        # Not on the broker's list: refused there, naming it and its list.
        with pytest.raises(FlowmeshError) as err:
            c.deploy("nope", "json:loads", seed=0)
        assert err.value.code == Code.NOT_ALLOWED
        assert "broker refused factory 'json:loads'" in err.value.reason
        assert "(flowmesh.examples, my_zoo)" in err.value.reason


def test_a_worker_narrows_the_list_and_says_so(user_module: str) -> None:
    with (
        LocalMesh(
            cpu_workers=1,
            memory_budget="8MiB",
            allow=["flowmesh.examples", "my_zoo"],
            worker_args=["--allow", "flowmesh.examples", "--allow", "somewhere.else"],
            env=env_with(user_module),
            **FAST,
        ) as mesh,
        mesh.client(timeout=120) as c,
    ):
        with pytest.raises(FlowmeshError) as err:
            c.deploy("mine", "my_zoo:stack", kwargs={"width": 32, "depth": 2}, seed=1)
        assert err.value.code == Code.NOT_ALLOWED, err.value
        # The worker applied the broker's list narrowed by its own: examples only.
        assert "worker worker-0 refused factory 'my_zoo:stack'" in err.value.reason
        assert "(flowmesh.examples)" in err.value.reason
        # What both allow still deploys and serves.
        c.deploy("ok", "flowmesh.examples:mlp", kwargs={"width": 32, "depth": 2}, seed=1)
        assert c.infer("ok", torch.randn(2, 32)).shape[0] == 2
