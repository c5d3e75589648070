"""Any torch.optim optimizer by name, and a user's optimizer factory from the allow-list, train
by memory flow exactly as plain PyTorch does (`flowmesh.optimizers`); the ones memory flow
cannot step are refused at open, saying why."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest
import torch
from torch import nn

from flowmesh import optimizers
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.chain import chain_of
from flowmesh.optimizers import OPTIMIZER_NAMES, state_count
from flowmesh.reference import train
from gpu_worker.device import CpuStandIn
from gpu_worker.train_config import TrainConfig
from gpu_worker.train_executor import TrainingExecutor
from gpu_worker.train_job import TrainingJob
from tests.support.train_cases import StateBeside

MIB = 1 << 20
STEPS = 6
TEST_ALLOW = ("tests.support",)


def net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 5))  # fmt: skip


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g))
            for _ in range(STEPS)]  # fmt: skip


def flow(
    optimizer: dict[str, Any], parts: int = 3, made: Callable[[TrainingJob], None] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = TrainConfig(optimizer, seed=1)
    blocks = chain_of(net())
    bounds = [round(i * len(blocks) / parts) for i in range(parts + 1)]
    job = TrainingJob("job", blocks, list(pairwise(bounds)), cfg, CpuStandIn(8 * MIB),
                      allow=TEST_ALLOW)  # fmt: skip
    if made is not None:  # the caller looks at it while it trains
        made(job)
    ex = TrainingExecutor(job.device)
    try:
        ex.open(job)
        futures = [ex.submit("job", x, y) for x, y in data()]
        losses = [f.result(timeout=120).loss for f in futures]
    finally:
        ex.close()
    return losses, job.state_dict()


# Options where the defaults would leave a state unused (momentum buffers, amsgrad's maximum).
OPTIONS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.05, "momentum": 0.9, "nesterov": True},
    "rmsprop": {"lr": 0.01, "momentum": 0.5, "centered": True},
    "adam": {"lr": 0.01, "amsgrad": True},
}
SKIP = {"muon": "takes 2-D parameters only (biases are 1-D): refused by torch at open"}


@pytest.mark.parametrize("name", [n for n in OPTIMIZER_NAMES if n not in SKIP])
def test_every_torch_optimizer_by_name_trains_as_plain_pytorch(name: str) -> None:
    optimizer = {"name": name, "lr": 0.01, **OPTIONS.get(name, {})}
    losses, weights = flow(optimizer)
    reference = net()
    expected = train(reference, optimizer, data(), rng_seed=1)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_users_optimizer_factory_from_the_allow_list_trains_as_plain_pytorch() -> None:
    optimizer = {"factory": "tests.support.optimizers:make", "lr": 0.003, "weight_decay": 0.1}
    losses, weights = flow(optimizer)
    reference = net()
    expected = train(reference, optimizer, data(), rng_seed=1)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert state_count(optimizer, TEST_ALLOW) == 1  # Lion's momentum


@pytest.mark.parametrize(
    ("optimizer", "code", "says"),
    [
        ({"name": "lbfgs"}, Code.BAD_REQUEST, "needs a closure"),
        ({"name": "sparseadam"}, Code.BAD_REQUEST, "sparse gradients"),
        ({"name": "adafactor"}, Code.BAD_REQUEST, "factored"),
        ({"name": "adamz"}, Code.BAD_REQUEST, "torch.optim has no such optimizer"),
        # One of the model's own parameters' shapes named, not a probe's (its torch.Size([2])).
        ({"name": "muon"}, Code.BAD_REQUEST, "parameter with size: torch.Size([16])"),
        ({"name": "sgd", "lr": 0.1, "momentun": 0.9}, Code.BAD_REQUEST, "momentun"),
        ({"factory": "os:system"}, Code.NOT_ALLOWED, "allow-list"),
        ({"factory": "tests.support.optimizers:nothing"}, Code.BAD_REQUEST, "not a callable"),
        ({"factory": "tests.support.optimizers:not_an_optimizer"}, Code.BAD_REQUEST, "not a torch"),
    ],
)
def test_what_memory_flow_cannot_step_is_refused_at_open(
    optimizer: dict[str, Any], code: Code, says: str
) -> None:
    with pytest.raises(FlowmeshError) as err:
        flow({"lr": 0.01, **optimizer} if "factory" in optimizer else optimizer)
    assert err.value.code == code and says in err.value.reason, err.value.reason


@pytest.mark.parametrize(
    ("optimizer", "count"),
    [("sgd", 0), ({"name": "sgd", "momentum": 0.9}, 1), ("adagrad", 1), ("adam", 2),
     ({"name": "Adam", "amsgrad": True}, 3), ("rprop", 2), ("nadam", 2), ("asgd", 1)],
)  # fmt: skip
def test_plans_count_the_state_each_optimizer_keeps(optimizer: Any, count: int) -> None:
    assert state_count(optimizer) == count


@pytest.mark.parametrize("part", [None, 512], ids=["whole", "in-parts"])
def test_a_first_update_makes_its_state_a_part_at_a_time(
    part: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sub-model's first update makes its optimizer's state beside the arena (on a device:
    beside what bounds its memory), and the host tier adopts it: in parts of at most
    FIRST_STATE_PART_BYTES of parameters (a parameter over it alone), each adopted before the
    next is made, with the same steps as plain PyTorch."""
    if part is not None:
        monkeypatch.setattr(optimizers, "FIRST_STATE_PART_BYTES", part)
    optimizer = {"name": "adam", "lr": 0.01, "amsgrad": True}  # three states per parameter
    jobs: list[TrainingJob] = []

    def watched() -> StateBeside.Watched:
        if not jobs:
            return [], []
        job = jobs[0]
        return [s.optimizer for s in job.subs], [job.device.arena, *(s.slab for s in job.subs)]

    with StateBeside(watched) as seen:
        losses, weights = flow(optimizer, parts=1, made=jobs.append)
    reference = net()
    expected = train(reference, optimizer, data(), rng_seed=1)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)
    params = [p.numel() * p.element_size() for p in net().parameters()]
    if part is None:  # every parameter's state at once, in one step
        assert seen.per_step[0] == 3 * sum(params)
    else:  # the 16x16 weight alone is over the part: the most at once
        assert len(seen.per_step) > STEPS
        assert max(seen.per_step) == 3 * max(params) < 3 * sum(params)
    assert seen.per_step[-1] == 0  # all of it adopted


def test_a_configuration_names_an_optimizer_or_a_factory_not_both() -> None:
    with pytest.raises(FlowmeshError, match="no 'name' beside it"):
        TrainConfig({"name": "adam", "factory": "tests.support.optimizers:make"})
    with pytest.raises(FlowmeshError, match="give 'name'"):
        TrainConfig({"lr": 0.1})
