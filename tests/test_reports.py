"""What the broker reports (`flowmesh.reports`): typed on the wire both ways, refused when
malformed, and plain data with the same names for `flowmesh status --json`."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import msgspec
import pytest

from flowmesh import protocol as p
from flowmesh.errors import Code
from tests.support.broker import MIB, Harness
from tests.support.reports import broker_status, job_row, model_row, worker_row


def a_status() -> p.BrokerStatus:
    """A status as the broker builds it: a worker, a partitioner, a deployed model."""
    h = Harness()
    h.partitioner()
    h.worker("w0")
    h.deploy("m", [3 * MIB], replicas=1)
    return h.core.status(h.now)


def header_of(msg: p.Message) -> dict[str, Any]:
    (frame,) = p.encode(msg)
    return msgpack.unpackb(frame)


def decode_header(header: dict[str, Any]) -> p.Message:
    return p.decode([msgpack.packb(header)])


def test_the_status_the_broker_builds_travels_whole() -> None:
    st = a_status()
    reply = p.decode(p.encode(p.StatusReply(id=4, status=st)))
    assert isinstance(reply, p.StatusReply) and reply.status == st
    (model,) = reply.status.models
    assert (model.name, model.state, model.stages[0].bytes) == ("m", "ready", 3 * MIB)
    assert [w.name for w in reply.status.workers] == ["w0"]
    jobs = [job_row("j", step=3, last_loss=0.5)]
    assert p.decode(p.encode(p.JobsReply(id=5, jobs=jobs))) == p.JobsReply(id=5, jobs=jobs)


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda h: h["status"]["models"][0].update(colour="red"), "colour"),  # unknown field
        (lambda h: h["status"]["models"][0].update(queue="3"), "$.status.models[0].queue"),
        (lambda h: h["status"]["models"][0].update(queue=-1), "$.status.models[0].queue"),
        (lambda h: h["status"]["workers"][0].update(ready=1), "$.status.workers[0].ready"),
        (lambda h: h["status"]["totals"].update(requests=True), "$.status.totals.requests"),
        (lambda h: h["status"]["models"][0].pop("stages"), "stages"),  # a missing field
        (lambda h: h["status"]["models"][0]["stages"][0].update(bytes=1.5), "bytes"),
        (lambda h: h["status"].update(models={}), "$.status.models"),
    ],
    ids=[
        "unknown-field",
        "str-for-int",
        "negative-count",
        "int-for-bool",
        "bool-for-int",
        "missing-field",
        "float-for-int",
        "map-for-list",
    ],
)
def test_a_malformed_status_row_is_refused_with_a_code_and_a_reason(
    change: Any, where: str
) -> None:
    header = header_of(p.StatusReply(id=9, status=a_status()))
    assert isinstance(decode_header(header), p.StatusReply)  # as sent: accepted
    change(header)
    with pytest.raises(p.DecodeError) as info:
        decode_header(header)
    assert info.value.code is Code.BAD_MESSAGE
    assert where in info.value.reason, info.value.reason
    assert info.value.ref == 9  # the answer it refuses can still be matched to its call


def test_a_malformed_job_row_or_deploy_answer_is_refused() -> None:
    header = header_of(p.JobsReply(id=3, jobs=[job_row("j")]))
    header["jobs"][0]["step"] = "many"
    with pytest.raises(p.DecodeError) as info:
        decode_header(header)
    assert info.value.code is Code.BAD_MESSAGE and "$.jobs[0].step" in info.value.reason
    header = header_of(p.Deployed(id=2, model=model_row("m")))
    header["model"]["replicas"] = [{"workers": "w0", "live": True, "inflight": 0}]
    with pytest.raises(p.DecodeError) as info:
        decode_header(header)
    assert info.value.code is Code.BAD_MESSAGE
    assert "$.model.replicas[0].workers" in info.value.reason


def test_status_as_plain_data_keeps_the_wire_names() -> None:
    """What `flowmesh status --json` prints: JSON whose keys are the fields' names."""
    st = broker_status(models=[model_row("m", requests=2)], workers=[worker_row("w0")])
    plain = json.loads(json.dumps(msgspec.to_builtins(st)))
    assert plain["models"][0]["name"] == "m" and plain["models"][0]["requests"] == 2
    assert plain["workers"][0]["stats"]["role"] == "worker" and plain["totals"]["requests"] == 0
    assert plain["workers"][0]["stats"]["kv_blocks_free"] is None
    assert msgspec.convert(plain, p.BrokerStatus) == st
