"""What crosses a cut and what a served model returns: refused when planning, not per request.

A cut never hands a tuple to the next stage (even with no declared inputs to run the forward on),
a model returning a tuple is refused when it is profiled for serving, and declared inputs that
forward cannot take are refused even for a model served uncut.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_meta, build_seeded
from flowmesh.modelio.chain import chain_of, run_chain
from flowmesh.modelio.profile import make_chunk_plan, profile
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from partitioner.stage_plans import make_stage_plan

HERE = __name__
ALLOW = (HERE,)
D = 8
X = {"x": {"dtype": "float32", "shape": [-1, D]}}


class Splitter(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.chunk(2, dim=-1)


class TupleMid(nn.Module):
    """A child returns a tuple that the forward unpacks; no declared inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 2 * D)
        self.split = Splitter()
        self.b = nn.Linear(D, D)
        self.c = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, q = self.split(self.a(x))
        return self.c(self.b(p) * q)


class ChunkMid(nn.Module):
    """A tuple from a tensor method, indexed rather than unpacked; no declared inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, 2 * D)
        self.b = nn.Linear(D, D)
        self.c = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.a(x).chunk(2, dim=-1)
        return self.c(self.b(parts[0]) + parts[1])


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.c = nn.Linear(D, 3)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class TupleOut(Heads):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.c(h), h


class DictOut(Heads):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.body(x)
        return {"logits": self.c(h), "hidden": h}


class TwoIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x) * mask))


class Steered(nn.Module):
    """Data-dependent control flow: served uncut, and not runnable on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * mask
        if h.sum() > 0:
            h = -h
        return self.b(h)


# The factories the specs name: each class builds its model.
tuple_mid, chunk_mid, tuple_out = TupleMid, ChunkMid, TupleOut
dict_out, two_in, steered = DictOut, TwoIn, Steered


def spec(factory: str, **kw) -> ModelSpec:
    return ModelSpec(name=factory.replace("_", "-"), factory=f"{HERE}:{factory}", seed=1, **kw)


def refusal(fn, *args, **kw) -> FlowmeshError:
    with pytest.raises(FlowmeshError) as info:
        fn(*args, **kw)
    return info.value


# -- defect: a tuple handed between stages ---------------------------------------------------------


@pytest.mark.parametrize("factory", ["tuple_mid", "chunk_mid"])
def test_no_cut_hands_a_tuple_on_without_declared_inputs(factory):
    model = build_seeded(spec(factory), ALLOW).eval()
    blocks = chain_of(model)
    assert blocks[0].uncut is None and len(blocks) >= 2
    x = torch.randn(3, D)
    with torch.no_grad():
        out = x
        for block in blocks[:-1]:  # every cut carries one tensor
            out = block.module(out)
            assert isinstance(out, torch.Tensor), block.name
        assert_forward_close(run_chain(blocks, x), model(x))


def test_a_tuple_mid_model_planned_in_two_stages_passes_a_tensor():
    plan = make_stage_plan(spec("tuple_mid"), stages=2, allow=ALLOW)
    model = build_seeded(spec("tuple_mid"), ALLOW).eval()
    blocks = chain_of(model)
    assert plan.block_names == tuple(b.name for b in blocks)
    (a, b), _ = plan.ranges
    x = torch.randn(2, D)
    with torch.no_grad():
        first = run_chain(blocks[a:b], x)
        assert isinstance(first, torch.Tensor)
        assert_forward_close(run_chain(blocks[b:], first), model(x))


# -- defect: a served model returning a tuple ------------------------------------------------------


def test_a_model_returning_a_tuple_is_refused_when_profiled_for_serving():
    exc = refusal(profile, spec("tuple_out", inputs=X), allow=ALLOW)
    assert exc.code == Code.BAD_REQUEST
    assert "returns a tuple" in exc.reason
    assert "a tensor or a dict of tensors" in exc.reason
    # Planning stages (what a deploy does) refuses it the same way.
    exc = refusal(make_stage_plan, spec("tuple_out", inputs=X), stages=2, allow=ALLOW)
    assert exc.code == Code.BAD_REQUEST and "returns a tuple" in exc.reason


def test_dict_outputs_are_served_and_training_takes_tuples():
    assert profile(spec("dict_out", inputs=X), allow=ALLOW).blocks
    # Training uses a tuple's first tensor: its profile does not refuse one.
    assert profile(spec("tuple_out", inputs=X), allow=ALLOW, serving=False).blocks
    plan = make_chunk_plan(spec("tuple_out", inputs=X), 1 << 20, "sgd", batch=2, allow=ALLOW)
    assert plan.ranges


# -- defect: declared inputs that forward cannot take, uncut ---------------------------------------


@pytest.mark.parametrize(
    "inputs",
    [
        {"a": X["x"], "b": X["x"]},  # names forward does not have
        X,  # one of two: passed positionally, `mask` is missing
    ],
    ids=["wrong-names", "one-of-two"],
)
@pytest.mark.parametrize("stages", [None, 2])
def test_declared_inputs_forward_cannot_take_are_refused(inputs, stages):
    exc = refusal(profile, spec("two_in", inputs=inputs, stages=stages), allow=ALLOW)
    assert exc.code == Code.BAD_REQUEST
    assert "TwoIn.forward(x, mask)" in exc.reason and "missing" in exc.reason


def test_an_uncut_model_with_matching_inputs_still_profiles():
    inputs = {"x": X["x"], "mask": X["x"]}
    assert chain_of(build_meta(spec("steered", inputs=inputs), ALLOW))[0].uncut is not None
    prof = profile(spec("steered", inputs=inputs), allow=ALLOW)
    assert prof.uncut is not None and [b.name for b in prof.blocks] == ["model"]
    assert [b.name for b in profile(spec("two_in", inputs=inputs), allow=ALLOW).blocks] == [
        "a",
        "b",
    ]
