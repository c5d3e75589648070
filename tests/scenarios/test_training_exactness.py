"""Exactness through the mesh, the whole grid (issue 7, section 3), on an in-process mesh
(tests/support/inproc.py): the example MLP, a tiny GPT with dropout, a small ResNet with
BatchNorm and Hugging Face GPT-2 with its tied embedding and head, each with SGD+momentum, Adam
and AdamW, cut into one to four sub-models, with and without gradient clipping: 96 jobs open at
once on one mesh, 20 steps each, all in flight together. Then again with each activation policy
forced on in turn (`activations` "recompute", "keep", "selective": what each sub-model's
backward does for its forward's activations, which "auto" chooses by measured cost), for the 72
jobs of two to four sub-models (one sub-model has no choice: its forward and backward are one
task).

Per-step losses and final parameters (read back from each job's checkpoint) are compared with a
plain PyTorch loop on the same seeds and data, with `torch.testing.assert_close` at rtol 1e-5 /
atol 1e-6 (README "Tests": training results are compared within tolerance, never bit for bit).
Plain PyTorch does not depend on the cut, so one reference run serves the four sub-model counts
of a (model, optimizer, clip) cell. The sub-model count of a job is forced by its chunk target
(`chunk_bytes`), found here with the partitioner the worker itself plans with.

The workers' cores, executors and training executors are the real ones, every message goes
through the real codec and the SDK on top is the real one: nothing here needs a process of its
own (what does stays in tests/mesh/).

`pytest -s` prints the exactness table (model x optimizer x sub-models x clip -> max relative
difference of the losses and of the parameters); it is also added to the file
`$FLOWMESH_EXACTNESS_TABLE` when that is set.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flowmesh.modelio.plan import chunk_plan
from flowmesh.modelio.profile import profile
from flowmesh.spec import ModelSpec
from tests.support.inproc import InProcMesh
from tests.support.mesh import roots_at
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.train_grid import (
    ALLOW,
    ATOL,
    BATCH,
    KIB,
    MODELS,
    OPTIMIZERS,
    RNG_SEED,
    RTOL,
    STEPS,
    TRAIN_BYTES,
    Data,
    Plain,
    data_for,
    plain_run,
)

CLIP = 0.5
PARTS = (1, 2, 3, 4)
CLIPS: tuple[float | None, ...] = (None, CLIP)
Cell = tuple[str, str, float | None]  # model, optimizer, clip: one plain PyTorch run


def chunk_targets(spec: ModelSpec, prof: Any, optimizer: dict[str, Any]) -> dict[int, int]:
    """A chunk target that makes the worker cut `spec` into k sub-models, for each k of PARTS:
    the middle of the range of targets that give k (the worker plans with the same profile:
    bytes only, at the micro-batch, sequence length 1)."""
    found: dict[int, list[int]] = {}
    target = 2 * KIB
    while target < 2048 * KIB:
        try:
            k = len(chunk_plan(prof, target, optimizer, BATCH).ranges)
        except Exception:  # below the largest block: no plan
            k = 0
        found.setdefault(k, []).append(target)
        target = math.ceil(target * 1.015)
    missing = [k for k in PARTS if k not in found]
    assert not missing, f"{spec.name}/{optimizer['name']}: no chunk target gives {missing} parts"
    return {k: found[k][len(found[k]) // 2] for k in PARTS}


@dataclass
class Case:
    model: str
    optimizer: str
    parts: int
    clip: float | None
    chunk_bytes: int
    name: str = ""
    sub_models: int = 0
    losses: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    error: str = ""
    # The activation policies its steps reported for the sub-models that have a choice.
    policies: set[str] = field(default_factory=set)

    @property
    def cell(self) -> Cell:
        return (self.model, self.optimizer, self.clip)


def rel_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| relative to the largest |expected| (the tensor's scale)."""
    a, e = actual.detach().double(), expected.detach().double()
    scale = float(e.abs().max()) if e.numel() else 0.0
    diff = float((a - e).abs().max()) if e.numel() else 0.0
    return diff / scale if scale > 0 else diff


def check(case: Case, want: Plain, activations: str) -> tuple[float, float, list[str]]:
    """(losses' max relative difference, parameters' max relative difference, failures)."""
    problems: list[str] = []
    if case.error:
        return math.inf, math.inf, [case.error]
    if case.sub_models != case.parts:
        problems.append(f"cut into {case.sub_models} sub-models, not {case.parts}")
    if activations != "auto" and case.policies != {activations}:
        problems.append(f"activation policies {sorted(case.policies)}, not {activations} forced")
    if case.steps != list(range(1, STEPS + 1)):
        problems.append(f"steps {case.steps}")
    got_l, want_l = torch.tensor(case.losses, dtype=torch.float64), torch.tensor(want.losses)
    loss_rel = float(((got_l - want_l).abs() / want_l.abs()).max())
    try:
        torch.testing.assert_close(got_l, want_l.double(), rtol=RTOL, atol=ATOL)
    except AssertionError as exc:
        problems.append(f"losses: {exc}")
    missing = want.params - set(case.state)
    if missing:
        problems.append(f"parameters missing from the checkpoint: {sorted(missing)}")
    param_rel = 0.0
    for n in sorted(set(case.state) & set(want.state)):
        got, exp = case.state[n], want.state[n]
        if exp.is_floating_point():
            param_rel = max(param_rel, rel_diff(got, exp))
        try:
            torch.testing.assert_close(got, exp, rtol=RTOL, atol=ATOL)
        except AssertionError as exc:
            problems.append(f"{n}: {exc}")
    if case.clip is not None and not any(g > case.clip for g in case.grad_norms):
        problems.append(f"the clip at {case.clip} was never exercised")
    return loss_rel, param_rel, problems


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


async def run_all(
    mesh: InProcMesh, cases: list[Case], data: dict[str, Data], out: Path, activations: str
) -> None:
    async with mesh.async_client(timeout=600.0) as client:

        async def open_job(case: Case) -> Any:
            s = MODELS[case.model]
            try:
                job = await client.train_open(
                    case.name,
                    s.factory,
                    kwargs=s.kwargs,
                    seed=s.seed,
                    optimizer=OPTIMIZERS[case.optimizer],
                    loss="cross_entropy",
                    batch_size=BATCH,
                    clip_grad_norm=case.clip,
                    rng_seed=RNG_SEED,
                    chunk_bytes=case.chunk_bytes,
                    activations=activations,
                    timeout=600.0,
                )
            except Exception as exc:
                case.error = f"open: {type(exc).__name__}: {exc}"
                return None
            case.sub_models = len(job.info.sub_models)
            return job

        async def train(case: Case, job: Any) -> None:
            try:
                # Every step of the job in flight at once; all the jobs' steps interleave.
                pending = [job.step_async(x, y, timeout=600.0) for x, y in data[case.model]]
                results = await asyncio.gather(*pending)
                case.losses = [r.loss for r in results]
                case.steps = [r.step for r in results]
                case.grad_norms = [r.metrics.get("grad_norm", 0.0) for r in results]
                case.policies = {p for r in results for p in r.activations[:-1]}
                saved = await job.save(str(out / case.name), timeout=600.0)
                await job.close(timeout=600.0)
            except Exception as exc:
                case.error = f"{type(exc).__name__}: {exc}"
                return
            tensors = load_file(str(Path(saved["path"]) / "state.safetensors"))
            case.state = {k: v for k, v in tensors.items() if "/" not in k}  # not optimizer/rng

        # Every job opened before any step is sent: see the module docstring.
        t0 = time.perf_counter()
        jobs = await asyncio.gather(*(open_job(c) for c in cases))
        t1 = time.perf_counter()
        await asyncio.gather(*(train(c, j) for c, j in zip(cases, jobs, strict=True) if j))
        t2 = time.perf_counter()
        print(f"\nopened {len(cases)} jobs in {t1 - t0:.1f} s, trained in {t2 - t1:.1f} s")


@pytest.mark.parametrize("activations", ["auto", "recompute", "keep", "selective"])
def test_the_whole_grid_through_the_mesh_equals_plain_pytorch(
    tmp_path: Path, activations: str
) -> None:
    pytest.importorskip("transformers")
    t0 = time.perf_counter()
    data = {m: data_for(m, seed=40 + i) for i, m in enumerate(MODELS)}
    parts = PARTS if activations == "auto" else tuple(k for k in PARTS if k > 1)
    cases: list[Case] = []
    for model, spec in MODELS.items():
        prof = profile(spec, batch=BATCH, seq_len=1, allow=ALLOW)
        for opt_name, opt in OPTIMIZERS.items():
            targets = chunk_targets(spec, prof, opt)
            for clip in CLIPS:
                for k in parts:
                    cases.append(Case(model, opt_name, k, clip, targets[k]))
    for i, c in enumerate(cases):
        c.name = f"x{i:02d}-{c.model}-{c.optimizer.split('+')[0]}-k{c.parts}-c{int(bool(c.clip))}"

    print(f"\nchunk targets in {time.perf_counter() - t0:.1f} s")
    with InProcMesh(
        cpu_workers=2,
        memory_budget="8MiB",
        train_bytes=TRAIN_BYTES,
        allow=ALLOW,
        **roots_at(tmp_path),
    ) as mesh:
        asyncio.run(run_all(mesh, cases, data, tmp_path, activations))

    # The plain PyTorch runs, after the mesh is gone (one per model x optimizer x clip).
    plain: dict[Cell, Plain] = {}
    for c in cases:
        if c.cell not in plain:
            plain[c.cell] = plain_run(c.model, OPTIMIZERS[c.optimizer], c.clip, data[c.model])

    print(f"plain runs done at {time.perf_counter() - t0:.1f} s")
    rows, failures = [], []
    for c in cases:
        loss_rel, param_rel, problems = check(c, plain[c.cell], activations)
        rows.append(
            [
                c.model,
                c.optimizer,
                str(c.parts),
                "-" if c.clip is None else f"{c.clip:g}",
                f"{loss_rel:.1e}",
                f"{param_rel:.1e}",
                "ok" if not problems else "FAIL",
            ]
        )
        if problems:
            failures.append(f"{c.name}: " + "; ".join(p.splitlines()[0] for p in problems[:3]))
    header = ["model", "optimizer", "sub-models", "clip", "losses rel", "params rel", ""]
    text = (
        f"exactness through the mesh, activations {activations}: {len(cases)} jobs x {STEPS} "
        "steps vs plain PyTorch "
        f"(assert_close rtol {RTOL:g}, atol {ATOL:g}); 'rel' = max |mesh - plain| / |plain| per "
        "loss, and per tensor relative to its largest |plain| value\n" + table(rows, header)
    )
    print("\n" + text)
    if os.environ.get("FLOWMESH_EXACTNESS_TABLE"):  # each run's table after the last's
        with Path(os.environ["FLOWMESH_EXACTNESS_TABLE"]).open("a") as f:
            f.write(text + "\n\n")
    assert not failures, f"{len(failures)} of {len(cases)} jobs differ:\n" + "\n".join(failures)
