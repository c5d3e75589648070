"""Mixed precision (issue 23): a job with `compute_dtype="bfloat16"` in-process on a CPU stand-in,
held to plain PyTorch AMP, the reference loop with its forward and loss under the same
`torch.autocast("cpu", dtype=torch.bfloat16)` (`tests.support.training.plain`).

Each job is cut into three sub-models, so the backward of the first two recomputes their
forward from the kept (bfloat16) input: that recompute must run under the forward's autocast.
Per-step losses and final tensors are compared with `torch.testing.assert_close` at rtol 1e-5 /
atol 1e-6, never bit for bit; the master weights and optimizer state stay float32 throughout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from torch import nn

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_seeded
from flowmesh.reference import cross_entropy
from flowmesh.train_spec import TrainConfig
from gpu_worker.train_checkpoint import load_checkpoint, read_meta
from gpu_worker.train_executor import TrainingExecutor, config_from
from gpu_worker.train_job import StepResult, TrainingJob
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_grid import ALLOW, MODELS, RNG_SEED, Data, data_for
from tests.support.training import close, job_of, plain

MIB = 1 << 20
BF16 = "bfloat16"
ADAM = {"name": "adam", "lr": 0.01}
PARTS = 3
STEPS = 12


def run(
    job: TrainingJob, data: Data, held_out: Data | None = None
) -> tuple[list[StepResult], list[float]]:
    """The job's steps, all in flight at once, then its evaluations of `held_out`."""
    with TrainingExecutor(job.device) as ex:
        ex.open(job)
        steps = [ex.submit(job.name, x, y) for x, y in data]
        evals = [ex.evaluate(job.name, x, y) for x, y in held_out or []]
        return [f.result(timeout=120) for f in steps], [f.result(timeout=120).loss for f in evals]


def amp(model: str, cfg: TrainConfig, data: Data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch AMP on the job's model, seed and data."""
    return plain(
        MODELS[model],
        cfg.optimizer,
        data,
        autocast=torch.bfloat16,
        clip=cfg.clip_grad_norm,
        accumulate=cfg.accumulate,
        rng_seed=cfg.seed,
    )


def amp_eval(model: str, state: dict[str, torch.Tensor], x: Any, y: torch.Tensor) -> float:
    """The held-out loss a PyTorch user gets from the trained model: eval mode, no grad, the
    forward and the loss under the training's autocast."""
    net = build_seeded(MODELS[model], ALLOW)
    net.load_state_dict(state)
    net.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return float(cross_entropy(net(x), y))


def assert_float32(job: TrainingJob) -> None:
    """The host tier's masters: every floating tensor, gradient home and optimizer state."""
    for n, info in job.tensors.items():
        homes = [info.home, *info.state_homes.values()]
        homes += [info.grad_home] if info.grad_home is not None else []
        for t in homes:
            assert not t.is_floating_point() or t.dtype == torch.float32, f"{n}: {t.dtype}"


CASES = [
    # model, clip, accumulate
    ("mlp", None, 1),
    ("mlp", 0.3, 2),
    ("gpt-dropout", None, 1),
    ("gpt-dropout", 0.3, 2),
    ("hf-gpt2-tied", 0.3, 2),
    ("resnet-bn", None, 1),
    ("resnet-bn", 0.5, 2),
]


@pytest.mark.parametrize(
    ("model", "clip", "accumulate"), CASES, ids=[f"{m}-clip{c}-acc{a}" for m, c, a in CASES]
)
def test_bfloat16_steps_match_plain_pytorch_amp(
    model: str, clip: float | None, accumulate: int
) -> None:
    cfg = TrainConfig(
        ADAM, clip_grad_norm=clip, accumulate=accumulate, seed=RNG_SEED, compute_dtype=BF16
    )
    data = data_for(model, 0)
    train, held_out = data[:STEPS], data[STEPS : STEPS + 2]
    job = job_of(model, cfg)
    results, evals = run(job, train, held_out)

    losses, state = amp(model, cfg, train)
    close([r.loss for r in results], losses, "per-step losses")
    assert [r.step for r in results] == list(range(1, STEPS + 1))
    got = job.state_dict()  # a tied weight once, under its owner's name
    assert set(got) <= set(state) and len(got) >= len(state) - 1
    for n, t in got.items():  # parameters and buffers (BatchNorm's running statistics)
        close(t, state[n], f"tensor {n} after training")
    assert_float32(job)
    if clip is not None:  # the clip was really exercised
        assert any(r.metrics["grad_norm"] > clip for r in results)
    # An evaluation runs its forward and loss under the same autocast, in eval mode.
    close(evals, [amp_eval(model, state, x, y) for x, y in held_out], "held-out losses")


def test_bfloat16_really_computes_in_bfloat16_on_float32_masters() -> None:
    f32 = job_of("mlp", TrainConfig(ADAM, seed=RNG_SEED))
    bf16 = job_of("mlp", TrainConfig(ADAM, seed=RNG_SEED, compute_dtype=BF16))
    seen: list[tuple[torch.dtype, torch.dtype]] = []  # (weight, output) of each Linear call

    def record(m: nn.Module, _: Any, out: torch.Tensor) -> None:
        seen.append((m.weight.dtype, out.dtype))

    for sub in bf16.subs:
        for block in sub.modules:
            for m in block.modules():
                if isinstance(m, nn.Linear):
                    m.register_forward_hook(record)
    data = data_for("mlp", 0)[:STEPS]
    f32_losses = [r.loss for r in run(f32, data)[0]]
    bf16_losses = [r.loss for r in run(bf16, data)[0]]

    # Autocast applied: the losses are not float32's within the tolerance exactness uses ...
    with pytest.raises(AssertionError, match="bfloat16 vs float32"):
        close(bf16_losses, f32_losses, "bfloat16 vs float32")
    # ... every Linear (forwards and recomputes alike) computed in bfloat16 on float32 weights ...
    assert seen and set(seen) == {(torch.float32, torch.bfloat16)}
    # ... while the masters stay float32, taking the float32 job's host bytes exactly.
    assert_float32(bf16)
    assert bf16.host_bytes() == f32.host_bytes()
    close([r.loss for r in run(job_of("mlp", f32.config), data)[0]], f32_losses, "float32 rerun")


def test_checkpoint_keeps_the_compute_dtype_and_resumes_the_same_run(tmp_path: Path) -> None:
    cfg = TrainConfig(ADAM, seed=RNG_SEED, compute_dtype=BF16)
    data = data_for("gpt-dropout", 1)[:STEPS]
    half = STEPS // 2
    first = job_of("gpt-dropout", cfg)
    with TrainingExecutor(first.device) as ex:
        ex.open(first)
        done = [ex.submit(first.name, x, y) for x, y in data[:half]]
        saved = ex.save(first.name, tmp_path / "ckpt")
        before = [f.result(timeout=120).loss for f in done]
        saved.result(timeout=60)

    meta = read_meta(tmp_path / "ckpt")
    assert meta["config"]["compute_dtype"] == BF16
    assert config_from(meta) == cfg
    # A checkpoint from before mixed precision has no compute dtype: it trains in float32.
    old = {k: v for k, v in meta["config"].items() if k != "compute_dtype"}
    assert config_from({"config": old}).compute_dtype == "float32"

    resumed = job_of("gpt-dropout", config_from(meta), parts=2)  # cut another way
    assert load_checkpoint(resumed, tmp_path / "ckpt") == half
    after = [r.loss for r in run(resumed, data[half:])[0]]
    losses, state = amp("gpt-dropout", cfg, data)
    close(before + after, losses, "losses across the resume")
    for n, t in state.items():
        close(resumed.state_dict()[n], t, f"tensor {n} after resuming")
    assert_float32(resumed)


@pytest.mark.parametrize("dtype", ["float16", "fp8", "int8", "bf16", ""])
def test_other_compute_dtypes_are_refused_with_the_reason(dtype: str) -> None:
    with pytest.raises(FlowmeshError) as info:
        TrainConfig(ADAM, compute_dtype=dtype)
    assert info.value.code is Code.BAD_REQUEST
    if dtype == "float16":
        assert "loss scaling" in info.value.reason and "'bfloat16'" in info.value.reason
    else:
        assert f"compute_dtype {dtype!r}" in info.value.reason
        assert "'float32', or 'bfloat16' for mixed precision" in info.value.reason


def train_open_frames(**config: Any) -> list[Any]:
    """A TrainOpen as a client of any version sends it, its config as given."""
    msg = p.TrainOpen(id=7, job="j", spec=MODELS["mlp"], config=TrainConfig(ADAM), batch=8)
    frames = p.encode(msg)
    head = msgpack.unpackb(frames[0])
    head["config"] = {"optimizer": ADAM, **config}
    return [msgpack.packb(head), *frames[1:]]


def test_the_compute_dtype_crosses_processes_in_train_open() -> None:
    msg = p.decode(train_open_frames(compute_dtype=BF16))
    assert isinstance(msg, p.TrainOpen) and msg.config is not None
    assert msg.config.compute_dtype == BF16
    # An older client sends none: float32, as before.
    old = p.decode(train_open_frames())
    assert isinstance(old, p.TrainOpen) and old.config is not None
    assert old.config.compute_dtype == "float32"
    with pytest.raises(p.DecodeError) as info:
        p.decode(train_open_frames(compute_dtype="float16"))
    assert info.value.code is Code.BAD_REQUEST and info.value.ref == 7
    assert "loss scaling" in info.value.reason
