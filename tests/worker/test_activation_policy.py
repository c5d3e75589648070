"""What a sub-model's backward does for its forward's activations (issue 23 §1,
`gpu_worker.activation_keep`): recompute the forward, or keep its graph. In-process on a CPU
stand-in with real torch.

Each policy forced in turn gives plain PyTorch's losses and tensors (`torch.testing.assert_close`,
rtol 1e-5 / atol 1e-6) on the grid's models with dropout, BatchNorm and tied weights, cut into
three sub-models, with accumulation and clipping; "auto" measures both and keeps the graph where
that costs less, as status reports. The hooks themselves are checked on a module whose
parameters are bound elsewhere in the arena for the backward than for the forward, the
forward's range overwritten in between.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flowmesh.train_spec import TrainConfig
from gpu_worker.activation_keep import KEEP, RECOMPUTE, KeptGraph, choose
from gpu_worker.train_executor import TrainingExecutor
from gpu_worker.train_scheduler import Task
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_grid import MODELS, RNG_SEED, data_for
from tests.support.training import close, job_of, plain

ADAM = {"name": "adam", "lr": 0.01}
STEPS = 6
CASES = [
    # model, clip, accumulate
    ("mlp", None, 1),
    ("gpt-dropout", 0.3, 2),
    ("hf-gpt2-tied", None, 1),
    ("resnet-bn", 0.5, 2),
]


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-grads", "arena-grads"])
@pytest.mark.parametrize("policy", [RECOMPUTE, KEEP])
@pytest.mark.parametrize(
    ("model", "clip", "accumulate"), CASES, ids=[f"{m}-clip{c}-acc{a}" for m, c, a in CASES]
)
def test_each_policy_forced_equals_plain_pytorch(
    policy: str, model: str, clip: float | None, accumulate: int, fresh: bool
) -> None:
    cfg = TrainConfig(
        ADAM, clip_grad_norm=clip, accumulate=accumulate, seed=RNG_SEED, activations=policy
    )
    data = data_for(model, STEPS)
    job = job_of(model, cfg)
    job.fresh_grads = fresh  # the gradients as the CPU stand-in makes them, or as a device
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        results = [f.result(timeout=120) for f in [ex.submit(model, x, y) for x, y in data]]
    assert [job.activation_policy(i) for i in range(job.parts)] == [policy, policy, "none"]
    losses, state = plain(
        MODELS[model], cfg.optimizer, data, clip=clip, accumulate=accumulate, rng_seed=cfg.seed
    )
    close([r.loss for r in results], losses, f"{model} {policy}: per-step losses")
    for name, t in job.state_dict().items():
        close(t, state[name], f"{model} {policy}: {name}")


def test_auto_measures_both_then_keeps_where_it_costs_less() -> None:
    """A job's first step recomputes and its second keeps (each measured on the way), with the
    same losses as plain PyTorch; later steps take the cheaper by the costs observed."""
    cfg = TrainConfig(ADAM, seed=RNG_SEED)
    assert cfg.activations == "auto"
    data = data_for("mlp", 3)
    job = job_of("mlp", cfg)
    seen, losses = [], []
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        for x, y in data[:2]:  # one at a time: each step is planned after the last one's costs
            losses.append(ex.step("mlp", x, y).loss)
            seen.append(job.activation_policy(0))
    assert seen == [RECOMPUTE, KEEP], seen
    close(losses, plain(MODELS["mlp"], cfg.optimizer, data[:2], rng_seed=cfg.seed)[0], "auto")
    # The choice from observed costs (the executor's clock, here given): the cheaper wins.
    for keep_s, want in ((0.5, KEEP), (3.0, RECOMPUTE)):
        job = job_of("mlp", cfg)
        for policy, seconds in ((RECOMPUTE, 1.0), (KEEP, keep_s)):
            job.observe(Task("mlp", 0, "forward", 0, frozenset(), frozenset(), sub=0,
                             payload={"policy": policy}), seconds)  # fmt: skip
        job.begin_step(1, *data[0])
        job.plan_step(1)
        assert job.activation_policy(0) == want


def test_choose_by_measured_cost() -> None:
    assert choose(None, None, None, None) == RECOMPUTE  # measure the recompute first
    assert choose(1.0, None, 10, 100) == KEEP  # then the keep
    assert choose(1.0, None, 200, 100) == RECOMPUTE  # a stash over the room is never tried
    assert choose(1.0, 0.5, 10, 100) == KEEP
    assert choose(1.0, 1.5, 10, 100) == RECOMPUTE
    assert choose(1.0, 0.5, 200, None) == KEEP  # no room limit


def test_a_kept_graph_follows_its_tensors_to_where_the_backward_binds_them() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    x = torch.randn(5, 8)
    ref(x).square().sum().backward()
    arena = torch.zeros(1 << 14, dtype=torch.uint8)
    params = dict(net.named_parameters())
    homes = {n: t.detach().clone() for n, t in params.items()}

    def bind(base: int) -> None:
        for n, t in params.items():
            view = arena[base : base + t.numel() * 4].view(torch.float32).view(t.shape)
            view.copy_(homes[n])
            t.data = view
            base += t.numel() * 4

    bind(64)
    kept = KeptGraph(params, arena, lambda t: t, lambda t: t)
    with kept.hooks():
        out = net(x)
    assert 0 < kept.saved_bytes < sum(t.numel() * 4 for t in homes.values()) + 4096
    arena.fill_(0xFF)  # the forward's range, taken by another task meanwhile
    bind(8192)
    out.square().sum().backward()
    for n, t in params.items():
        torch.testing.assert_close(t.grad, dict(ref.named_parameters())[n].grad, msg=n)
