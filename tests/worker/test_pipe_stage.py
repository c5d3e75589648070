"""Pipeline stages of a training job (`gpu_worker.pipe_stage`) in process: the models and
optimizers of the memory-flow exactness table (tests/worker/test_training.py), cut into 2 and 3
stages, each stage built from its own copy of the seeded model as its worker builds it (so a
tied weight has one copy per stage that uses it), stepped in GPipe order: per-step losses and
final parameters equal plain PyTorch within the tolerance rule (rtol 1e-5, atol 1e-6); in
bfloat16 (mixed precision), equal plain PyTorch AMP."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flowmesh import optimizers
from flowmesh.modelio import planners
from flowmesh.modelio.build import build_seeded
from flowmesh.modelio.chain import chain_of
from flowmesh.modelio.inputs import declared_inputs, make_inputs
from flowmesh.modelio.profile import profile
from flowmesh.spec import ModelSpec
from gpu_worker.device import CpuStandIn
from gpu_worker.pipe_stage import PipeStage, build_stage, job_rng, step_in_process
from gpu_worker.train_config import TrainConfig
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_cases import (
    CASES,
    STEPS,
    StateBeside,
    build,
    close,
    data_for,
    even_ranges,
    pipe_stages,
    plain_step_loop,
)
from tests.support.train_grid import ALLOW as GRID_ALLOW
from tests.support.train_grid import MODELS, RNG_SEED
from tests.support.train_grid import data_for as grid_data
from tests.support.training import plain

PIPE_CASES = [(*case[:2], stages, *case[3:]) for case in CASES for stages in (2, 3)]


def merged(stages: list[PipeStage]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for s in stages:
        out.update(s.state_dict())
    return out


def placed(pipe: list[PipeStage]) -> list[CpuStandIn]:
    """Each stage in an arena of its own (as on its worker), at an offset inside it, the arena
    filled with NaN first: a tensor left beside it, or a slot read before written, shows."""
    arenas = []
    for stage in pipe:
        nbytes = stage.lay_out(GRID_ALLOW)
        dev = CpuStandIn(nbytes + 1024, prefault=False)
        dev.arena.view(torch.float32).fill_(float("nan"))
        stage.place(dev.arena, 512)
        arenas.append(dev)
    return arenas


def assert_in_arena(pipe: list[PipeStage], arenas: list[CpuStandIn]) -> None:
    for stage, dev in zip(pipe, arenas, strict=True):
        lo = dev.arena.data_ptr()
        kept = stage.in_arena()
        params = [i for i in stage.tensors.values() if i.is_param]
        assert len(kept) > len(params) or stage.optimizer is None or not stage.owned
        for t in kept:
            assert lo + 512 <= t.data_ptr() < lo + dev.arena.numel(), "a tensor beside the arena"


@pytest.mark.parametrize("where", ["beside", "arena"])
@pytest.mark.parametrize(
    ("kind", "optimizer", "stages", "clip", "accumulate"),
    PIPE_CASES,
    ids=[f"{c[0]}-{c[1]['name']}-p{c[2]}-clip{c[3]}-acc{c[4]}" for c in PIPE_CASES],
)
def test_pipelined_steps_match_plain_pytorch(
    kind: str,
    optimizer: dict[str, Any],
    stages: int,
    clip: float | None,
    accumulate: int,
    where: str,
) -> None:
    """`where`: the stages' tensors as built, or placed in an arena as on a worker (their
    parameters, and their optimizer state once the first update made it)."""
    cfg = TrainConfig(optimizer, clip_grad_norm=clip, accumulate=accumulate, seed=21)
    data = data_for(kind)
    pipe = pipe_stages(kind, cfg, stages)
    arenas = placed(pipe) if where == "arena" else []
    if kind == "gpt2":  # the tied embedding: lent by stage 0, borrowed by the last
        assert "transformer.wte.weight" in pipe[0].lent
        assert [i.name for i in pipe[-1].borrowed] == ["transformer.wte.weight"]
    rng = job_rng(cfg.seed)
    losses, norms = [], []
    for x, y in data:
        loss, rng, total = step_in_process(pipe, x, y, rng)
        losses.append(loss)
        norms.append(total)

    reference = build(kind)
    expected = plain_step_loop(reference, cfg, data)
    close(losses, expected, "per-step losses")
    got = merged(pipe)
    want = reference.state_dict()
    params = {n for n, _ in reference.named_parameters()}
    assert params <= set(got), f"parameters no stage owns: {params - set(got)}"
    for n in want:
        if n in got:
            close(got[n], want[n], f"tensor {n} after {STEPS} steps")
    if kind == "gpt2":  # the borrowed copy follows its owner's updates
        close(pipe[-1].tensors["transformer.wte.weight"].tensor, got["transformer.wte.weight"])
    if clip is not None:
        assert any(float(t) > clip for t in norms if t is not None)
    if arenas:
        assert_in_arena(pipe, arenas)


@pytest.mark.parametrize("part", [None, 1], ids=["whole", "each-parameter"])
def test_a_placed_stages_first_update_makes_its_state_a_part_at_a_time(
    part: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first update of a stage placed in its arena makes the optimizer's state beside it (on
    a GPU, beside the arena that took most of the device) before the state moves in: in parts
    of at most FIRST_STATE_PART_BYTES of parameters, each moved in before the next is made;
    the same steps as plain PyTorch."""
    if part is not None:
        monkeypatch.setattr(optimizers, "FIRST_STATE_PART_BYTES", part)
    cfg = TrainConfig({"name": "adam", "lr": 0.01, "amsgrad": True}, seed=21)
    data = data_for("mlp", steps=4)
    pipe = pipe_stages("mlp", cfg, 2)
    arenas = placed(pipe)
    optimizers_and_arenas = ([s.optimizer for s in pipe], [dev.arena for dev in arenas])
    with StateBeside(lambda: optimizers_and_arenas) as seen:
        rng = job_rng(cfg.seed)
        losses = []
        for x, y in data:
            loss, rng, _ = step_in_process(pipe, x, y, rng)
            losses.append(loss)
    reference = build("mlp")
    close(losses, plain_step_loop(reference, cfg, data), "per-step losses")
    got = merged(pipe)
    for n, want in reference.state_dict().items():
        close(got[n], want, f"tensor {n}")
    assert_in_arena(pipe, arenas)
    sizes = [[i.tensor.numel() * i.tensor.element_size() for i in s.owned] for s in pipe]
    if part is None:  # a stage's whole state at once, in its first step
        assert sorted(seen.per_step[:2]) == sorted(3 * sum(b) for b in sizes)
    else:  # one parameter's state at most
        assert max(seen.per_step) == 3 * max(max(b) for b in sizes)
        assert len(seen.per_step) == sum(len(b) for b in sizes) + (len(data) - 1) * len(pipe)
    assert seen.per_step[-len(pipe) :] == [0] * len(pipe)


def test_a_stage_cut_where_no_floating_activation_passes_is_refused() -> None:
    cfg = TrainConfig({"name": "sgd", "lr": 0.1})
    pipe = pipe_stages("mlp", cfg, 2)
    with pytest.raises(Exception, match="floating activation"):
        pipe[1].last(0, torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                     job_rng(0))  # fmt: skip


def test_an_update_before_every_backward_is_refused_and_abort_leaves_the_weights() -> None:
    cfg = TrainConfig({"name": "sgd", "lr": 0.1})
    pipe = pipe_stages("mlp", cfg, 2)
    before = merged(pipe)
    x, y = data_for("mlp", steps=1)[0]
    act, rng = pipe[0].forward(0, x, job_rng(0))
    pipe[1].last(0, act, y, rng)
    with pytest.raises(Exception, match=r"micro-batches \[0\] not run"):
        pipe[0].update(None)
    for s in pipe:
        s.abort()
    after = merged(pipe)
    for n, t in before.items():
        assert torch.equal(after[n], t), n  # bit-exact: an abort moves no weight


MP_CASES = [
    ("mlp", 0.3, 2),
    ("gpt-dropout", 0.3, 2),
    ("hf-gpt2-tied", 0.3, 2),
    ("resnet-bn", None, 2),
]


def grid_stages(model: str, cfg: TrainConfig, n: int) -> list[PipeStage]:
    if model == "hf-gpt2-tied":
        pytest.importorskip("transformers")
    spec = MODELS[model]
    stages = []
    for s in range(n):
        net = build_seeded(spec, GRID_ALLOW)
        inputs = declared_inputs(spec, net)
        blocks = chain_of(net, make_inputs(inputs, 1, 1, "cpu") if inputs is not None else None)
        stages.append(PipeStage(model, blocks, even_ranges(len(blocks), n), s, cfg))
    return stages


@pytest.mark.parametrize(("model", "clip", "accumulate"), MP_CASES)
@pytest.mark.parametrize("stages", [2, 3])
def test_bfloat16_pipelined_steps_match_plain_pytorch_amp(
    model: str, clip: float | None, accumulate: int, stages: int
) -> None:
    cfg = TrainConfig(
        {"name": "adam", "lr": 0.01}, clip_grad_norm=clip, accumulate=accumulate,
        seed=RNG_SEED, compute_dtype="bfloat16",
    )  # fmt: skip
    data = grid_data(model, 0)[:8]
    pipe = grid_stages(model, cfg, stages)
    rng = job_rng(cfg.seed)
    losses = []
    for x, y in data:
        loss, rng, _ = step_in_process(pipe, x, y, rng)
        losses.append(loss)
    expected, state = plain(
        MODELS[model], cfg.optimizer, data, autocast=torch.bfloat16, clip=clip,
        accumulate=accumulate, rng_seed=cfg.seed,
    )  # fmt: skip
    close(losses, expected, "per-step losses")
    got = merged(pipe)
    assert set(got) <= set(state) and len(got) >= len(state) - 1
    for n, t in got.items():
        close(t, state[n], f"tensor {n} after training")
        assert not t.is_floating_point() or t.dtype == torch.float32, n  # float32 masters


MASKED = ModelSpec(name="masked", factory="tests.support.train_models:masked_mlp",
                   kwargs={"width": 32, "depth": 4}, seed=7)  # fmt: skip


@pytest.mark.parametrize("model", [*MODELS, "masked"])
@pytest.mark.parametrize("stages", [2, 3])
def test_the_brokers_pipeline_plan_cuts_as_the_workers_do_and_bounds_their_footprint(
    model: str, stages: int
) -> None:
    """What `pipeline="auto"` plans from a profile (`planners.even_cut`, `stage_footprints`,
    in the partitioner) is the cut each stage's worker makes of the built chain, and no stage
    holds more than the plan counted (buffers outside the state_dict included: "masked"), so
    a plan that fits is not refused `too_big`."""
    spec = MODELS.get(model, MASKED)
    cfg = TrainConfig({"name": "adam", "lr": 0.01})
    prof = profile(spec, batch=1, allow=GRID_ALLOW)
    ranges = planners.even_cut([b.resident_bytes for b in prof.blocks], stages)
    planned = planners.stage_footprints(prof, ranges, cfg.optimizer, 2)
    for s in range(stages):
        built = build_stage("job", spec, cfg, s, stages, "cpu", GRID_ALLOW)
        assert built.ranges == ranges
        assert built.footprint(GRID_ALLOW) <= planned[s], (s, built.footprint(GRID_ALLOW))
