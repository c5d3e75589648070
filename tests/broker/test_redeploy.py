"""A model undeployed and deployed again under its name while a batch of the old one is between
stages, in process (`Harness`: fake workers, relayed stages, a fake clock): the old batch's
requests are answered as undeployed, never run on the new model (whose inputs they were not
checked against) nor counted in its figures. Every message out is asserted."""

from __future__ import annotations

from broker.core import CLIENT
from flowmesh import protocol as p
from flowmesh.errors import Code
from tests.support.broker import CLIENT_A, CLIENT_B, MIB, Harness, only


def test_a_batch_between_stages_of_a_model_deployed_again_is_answered_undeployed() -> None:
    h = Harness()
    h.partitioner()
    h.worker("w0"), h.worker("w1")
    h.deploy("m", [MIB, MIB], replicas=1)
    rid, out = h.infer("m", CLIENT_B)
    for _, addr, load in out:
        if isinstance(load, p.Load):
            h.loaded(addr, [("", addr, load)], MIB)
    ((first, run),) = [(a, m) for _, a, m in out if isinstance(m, p.Run)]
    assert run.stage == 0
    # Undeployed while stage 0 runs; then another model of that name, taking width 8.
    undeployed = h.client(CLIENT_A, p.Undeploy(id=90, model="m"))
    assert [type(m) for dest, _, m in undeployed if dest == CLIENT] == [p.Undeployed]
    h.deploy("m", [MIB], replicas=1, inputs={"x": {"dtype": "float32", "shape": [-1, 8]}})
    out = h.finish(first, run)
    assert [(d, a, m) for d, a, m in out] == [
        (
            CLIENT,
            CLIENT_B,
            p.Error(
                id=rid, code=str(Code.MODEL_NOT_FOUND), reason="'m' was undeployed while running"
            ),
        )
    ]
    (row,) = [r for r in h.core.status(h.now).models if r.name == "m"]
    assert (row.requests, row.completed) == (0, 0)
    assert only(h.out(), p.Run) == []
