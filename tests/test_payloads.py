"""The payloads messages carry (model spec, plan, training configuration) are declared types,
checked as a message is decoded: a malformed one is refused there with BAD_REQUEST and a reason
naming the field; and a stage's digest is the one state directories already hold."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from flowmesh import protocol as p
from flowmesh.errors import Code
from flowmesh.modelio.plan import Plan
from flowmesh.spec import ModelSpec

SPEC = {"name": "m", "factory": "flowmesh.examples:mlp", "seed": 0}
PLAN = {
    "kind": "stages",
    "spec_digest": "d",
    "block_names": ["a", "b"],
    "block_bytes": [1, 2],
    "ranges": [[0, 1], [1, 2]],
    "range_bytes": [1, 2],
    "objective": "bytes",
    "version": 1,
}
CONFIG = {"optimizer": {"name": "adam", "lr": 0.01}, "loss": "mse"}


def header(**fields: Any) -> list[bytes]:
    """A message as any sender may write it: a plain msgpack map."""
    return [msgpack.packb({"v": p.PROTOCOL_VERSION, **fields})]


def refusal(frames: list[bytes]) -> tuple[Code, str, int | None]:
    with pytest.raises(p.DecodeError) as info:
        p.decode(frames)
    return info.value.code, info.value.reason, info.value.ref


def test_well_formed_payloads_decode_to_their_types() -> None:
    deploy = p.decode(header(t="deploy", id=1, spec=SPEC))
    assert isinstance(deploy, p.Deploy) and deploy.spec == ModelSpec(**SPEC)  # type: ignore[arg-type]
    reply = p.decode(header(t="plan_reply", id=2, plan=PLAN))
    assert isinstance(reply, p.PlanReply) and reply.plan == Plan.from_dict(PLAN)
    opening = p.decode(header(t="train_open", id=3, job="j", spec=SPEC, config=CONFIG, batch=4))
    assert isinstance(opening, p.TrainOpen) and opening.config is not None
    assert (opening.config.optimizer_name, opening.config.loss) == ("adam", "mse")
    resuming = p.decode(header(t="train_open", id=4, job="j", spec=SPEC, config=None, batch=4))
    assert isinstance(resuming, p.TrainOpen) and resuming.config is None


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ({**SPEC, "name": "no spaces"}, "model name 'no spaces'"),
        ({**SPEC, "name": 5}, "Expected `str`, got `int` - at `$.spec.name`"),
        ({**SPEC, "max_batch": 4}, "unknown field `max_batch` - at `$.spec`"),
        ({**SPEC, "weights": "w.safetensors"}, "either weights or seed"),
        ({**SPEC, "inputs": {"x": {"dtype": "complex", "shape": [1]}}}, "dtype 'complex'"),
        # A float32 input to a float16 model: every request would fail (the meta run that
        # profiles it does not check dtypes).
        (
            {**SPEC, "dtype": "float16", "inputs": {"x": {"dtype": "float32", "shape": [-1, 4]}}},
            "input 'x' is declared float32, but the model is deployed in float16",
        ),
        ({"name": "m"}, "factory None"),
        ("m", "Expected `object`, got `str` - at `$.spec`"),
    ],
)
def test_a_deploy_with_a_malformed_spec_is_refused_on_receipt(spec: Any, said: str) -> None:
    code, reason, ref = refusal(header(t="deploy", id=7, spec=spec))
    assert (code, ref) == (Code.BAD_REQUEST, 7)
    assert said in reason and "$.spec" in reason, reason


@pytest.mark.parametrize(
    ("plan", "said"),
    [
        ({**PLAN, "range_bytes": ["lots"]}, "at `$.plan.range_bytes[0]`"),
        ({**PLAN, "ranges": [[0, 0], [0, 2]]}, "bad plan: range [0, 0] is empty"),
        ({**PLAN, "ranges": [[0, 1], [1, 3]]}, "ranges end at block 3, but the model has 2"),
        ({**PLAN, "version": 2}, "plan version 2 is not supported"),
        ({**PLAN, "extra": 1}, "unknown field `extra`"),
    ],
)
def test_a_plan_reply_with_a_malformed_plan_is_refused_on_receipt(plan: Any, said: str) -> None:
    code, reason, ref = refusal(header(t="plan_reply", id=8, plan=plan))
    assert (code, ref) == (Code.BAD_REQUEST, 8)
    assert said in reason and "$.plan" in reason, reason


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({**CONFIG, "optimizer": {"name": "lion; rm"}}, "optimizer 'lion; rm'"),
        ({**CONFIG, "optimizer": {"factory": "lion"}}, "optimizer factory 'lion'"),
        ({**CONFIG, "accumulate": 0}, "accumulate must be a positive integer"),
        ({**CONFIG, "clip_grad_norm": -1.0}, "clip_grad_norm must be a positive number"),
        ({**CONFIG, "loss": "hinge"}, "loss 'hinge'"),
        ({**CONFIG, "momentum": 0.9}, "unknown field `momentum`"),
        ({"loss": "mse"}, "missing required field `optimizer`"),
    ],
)
def test_a_train_open_with_a_malformed_config_is_refused_on_receipt(config: Any, said: str) -> None:
    frames = header(t="train_open", id=9, job="j", spec=SPEC, config=config, batch=4)
    code, reason, ref = refusal(frames)
    assert (code, ref) == (Code.BAD_REQUEST, 9)
    assert said in reason and "$.config" in reason, reason


def test_a_plan_job_s_request_is_typed_and_checked_too() -> None:
    request = {"spec": SPEC, "kind": "chunks", "target_bytes": 1 << 20, "batch": 2}
    job = p.decode(header(t="plan_job", id=5, request=request))
    assert isinstance(job, p.PlanJob) and job.request.spec.name == "m"
    assert (job.request.kind, job.request.target_bytes, job.request.optimizer) == (
        "chunks",
        1 << 20,
        "adam",
    )
    code, reason, _ = refusal(header(t="plan_job", id=5, request={**request, "spec": {"x": 1}}))
    assert code == Code.BAD_REQUEST and "$.request.spec" in reason, reason


# The digest of this spec, plan and stage as the broker before typed payloads computed it (and
# wrote it in state directories and workers' inventories): it must not change.
DIGEST_SPEC = {
    "name": "m",
    "factory": "flowmesh.examples:mlp",
    "kwargs": {"width": 8, "depth": 2},
    "seed": 3,
    "inputs": {"x": {"dtype": "float32", "shape": [-1, 8]}},
    "slo_ms": 50,
}
KEPT_DIGEST = "acc3988ee4a0d6a8cbf13536"


def digest_plan(spec: ModelSpec) -> Plan:
    return Plan(
        kind="stages",
        spec_digest=spec.digest(),
        block_names=("a", "b", "c"),
        block_bytes=(10, 20, 30),
        ranges=((0, 1), (1, 3)),
        range_bytes=(10, 50),
        objective="time",
        range_time_s=(0.5, 1),
        request={"stages": 2, "mem_cap": None},
    )


def test_a_stage_digest_is_the_one_kept_typed_stored_or_received() -> None:
    spec = ModelSpec.from_dict(DIGEST_SPEC)
    plan = digest_plan(spec)
    assert spec.digest() == "b043f7425fe24bd5"
    assert p.stage_digest(spec, plan, 1) == KEPT_DIGEST
    assert p.stage_digest(spec.to_dict(), plan.to_dict(), 1) == KEPT_DIGEST  # as stored
    sent = p.DeployStage(id=1, model="m", stage=1, spec=spec, plan=plan)
    got = p.decode(p.encode(sent))  # as a worker computes it
    assert isinstance(got, p.DeployStage)
    assert p.stage_digest(got.spec, got.plan, got.stage) == KEPT_DIGEST
