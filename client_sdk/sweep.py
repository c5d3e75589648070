"""Hyper-parameter sweeps through the mesh: Optuna's ask-and-tell interface drives trials as
training jobs, and its pruners (successive halving, Hyperband) stop the bad ones early.

Each trial asks the study for its parameters, opens a job, trains `steps` steps and every
`eval_every` steps evaluates on held-out rows, reporting the value to Optuna. When the pruner
says stop, the job is closed at once, so its training memory goes to the trials still running.
At most `concurrency` trials run at a time.

The search space is plain data (a TOML table, a JSON object): each name maps to a distribution,
`{"type": "float", "low": 1e-4, "high": 0.1, "log": true}`, `{"type": "int", "low": 8, "high":
64, "step": 8}` or `{"type": "categorical", "choices": ["adam", "sgd"]}`. Where a value goes:

| name                                  | goes to                                        |
|---------------------------------------|------------------------------------------------|
| `optimizer`                           | the optimizer's name ("sgd", "adam", "adamw")  |
| `lr`, `weight_decay`, `momentum`      | the optimizer's settings                       |
| `optim.<key>`                         | the optimizer's setting `<key>` (torch.optim)  |
| anything else, e.g. `width`           | the factory's keyword argument of that name    |

A sampled value overrides the fixed `kwargs` / `optimizer` given to the sweep.

A trial whose training loss turns non-finite (a diverged learning rate) is pruned at once. A
mesh that takes no training jobs (no worker started with `--train-bytes`) refuses the sweep at
once: the broker's answer to the first job opening is raised, before any trial trains, and
nothing is saved.
Several drivers, on one mesh or on several, can work on one study: give each the same `name`
and a `storage` (`open_storage`): an SQLAlchemy URL (`sqlite:///sweep.db` for one host,
`postgresql+psycopg://user@host/db` for many) or `journal:PATH` (Optuna's journal file). The
study's storage is then the shared state: `trials` counts the finished trials (complete, pruned
or failed) of the whole study, whichever driver ran them. An RDB storage carries heartbeats:
each driver beats for its running trials every `heartbeat_interval` seconds; a trial whose
driver died (no beat for `grace_period` seconds) is marked FAIL by the next driver that looks and
enqueued again (Optuna's `RetryFailedTrialCallback`) as a new trial with the same parameters,
which the next free driver runs. A trial number is taken once, from the storage, and its mesh
job is `<name>-t<number>`: no trial runs twice. The journal storage has no heartbeat: a dead
driver's trials stay RUNNING there and are not retried.
Results go to `out_dir`: `trials.json` (every trial's parameters, state, value, per-step training
losses and evaluations, and the workers its job trained on) and `curves.png` (every trial's
curves; pruned trials dashed and marked where they stopped, a trial far above the others clipped
off the axis: `client_sdk.sweep_plot`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import math
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import optuna

from client_sdk import sweep_plot
from client_sdk.connection import Connection
from client_sdk.jobs import AsyncJob
from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError

if TYPE_CHECKING:  # the data's type only: reading data files is no part of the SDK's import
    import torch

    from client_sdk.train_data import Dataset

# Heartbeats and their retries are marked experimental, and heartbeats outside `optimize` draw a
# warning, though ask-and-tell with our own beats is what they are for here: one warning per
# driver is noise on the CLI's stderr.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", "Heartbeat of storage is supposed", UserWarning)


class Trains(Protocol):
    """What a sweep drives: an `AsyncClient`, through its `train_open` (and its connection, to
    close a dead driver's jobs)."""

    train_open: Callable[..., Awaitable[AsyncJob]]
    connection: Connection


OPTIMIZER_KEYS = {"lr", "weight_decay", "momentum"}
OPTIM_PREFIX = "optim."
PRUNERS = ("successive_halving", "hyperband", "none")


@dataclass
class TrialRecord:
    """One trial as the sweep saw it; `curve` is the training loss of every step, `evals` the
    (step, objective) pairs reported to Optuna."""

    number: int
    params: dict[str, Any]
    job: str
    state: str = "WAITING"  # RUNNING, then COMPLETE, PRUNED or FAIL
    step: int = 0
    value: float | None = None
    curve: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0
    # Where its job trained: its worker, or a pipelined job's stages' workers in stage order.
    workers: list[str] = field(default_factory=list)

    @property
    def last_loss(self) -> float | None:
        return self.curve[-1] if self.curve else None


@dataclass
class SweepResult:
    name: str
    objective: str
    direction: str
    trials: list[TrialRecord]
    study: optuna.Study
    out_dir: Path | None = None

    @property
    def completed(self) -> list[TrialRecord]:
        return [t for t in self.trials if t.state == "COMPLETE"]

    @property
    def best(self) -> TrialRecord | None:
        """The best completed trial (Optuna's `best_trial`), or None when none completed."""
        if not self.completed:
            return None
        # With shared storage the study's best may be a trial another driver ran.
        number = self.study.best_trial.number
        return next((t for t in self.trials if t.number == number), None)

    @property
    def study_best(self) -> optuna.trial.FrozenTrial | None:
        """The study's best trial, whichever driver ran it, or None when none completed."""
        try:
            return self.study.best_trial
        except ValueError:
            return None

    @property
    def json_path(self) -> Path | None:
        return self.out_dir / "trials.json" if self.out_dir else None

    @property
    def png_path(self) -> Path | None:
        return self.out_dir / "curves.png" if self.out_dir else None

    def to_json(self) -> dict[str, Any]:
        best = self.best
        return {
            "name": self.name,
            "objective": self.objective,
            "direction": self.direction,
            "best": None if best is None else {"number": best.number, "value": best.value},
            "trials": [{**asdict(t), "evals": [list(e) for e in t.evals]} for t in self.trials],
        }

    def table(self) -> str:
        """The trials as a text table, best first (completed by value, then the rest)."""
        sign = -1.0 if self.direction == "maximize" else 1.0

        def key(t: TrialRecord) -> tuple[int, float, int]:
            if t.state == "COMPLETE" and t.value is not None:
                return (0, sign * t.value, t.number)
            return (1, 0.0, t.number)

        rows = [_row(t) for t in sorted(self.trials, key=key)]
        header = ["trial", "params", "step", "last loss", self.objective, "state"]
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        lines = [
            "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True))
            for r in [header, *rows]
        ]
        return "\n".join(line.rstrip() for line in lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _row(t: TrialRecord) -> list[str]:
    params = " ".join(f"{k}={_fmt(v)}" for k, v in t.params.items())
    last = "-" if t.last_loss is None else f"{t.last_loss:.4f}"
    if t.value is not None:
        value = f"{t.value:.4f}"
    else:  # a pruned or running trial: its last evaluation, which is not its value
        value = f"({t.evals[-1][1]:.4f})" if t.evals else "-"
    state = t.state + (f" ({t.reason})" if t.reason else "")
    return [str(t.number), params, str(t.step), last, value, state]


def distribution(name: str, d: Mapping[str, Any]) -> optuna.distributions.BaseDistribution:
    """An Optuna distribution from its plain-data form (see the module docstring)."""
    kind = d.get("type")
    try:
        if kind == "float":
            return optuna.distributions.FloatDistribution(
                float(d["low"]), float(d["high"]), log=bool(d.get("log", False)), step=d.get("step")
            )
        if kind == "int":
            return optuna.distributions.IntDistribution(
                int(d["low"]),
                int(d["high"]),
                log=bool(d.get("log", False)),
                step=int(d.get("step", 1)),
            )
        if kind == "categorical":
            return optuna.distributions.CategoricalDistribution(list(d["choices"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"space[{name!r}]: {exc!s}") from None
    raise ValueError(f"space[{name!r}]: type must be float, int or categorical, got {kind!r}")


def split_params(
    params: Mapping[str, Any], kwargs: Mapping[str, Any], optimizer: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The factory kwargs and optimizer settings of a trial (see the module docstring)."""
    kw, opt = dict(kwargs), dict(optimizer)
    for k, v in params.items():
        if k == "optimizer":
            opt["name"] = v
        elif k in OPTIMIZER_KEYS:
            opt[k] = v
        elif k.startswith(OPTIM_PREFIX):
            opt[k.removeprefix(OPTIM_PREFIX)] = v
        else:
            kw[k] = v
    if opt.get("name") != "sgd":
        opt.pop("momentum", None)  # only SGD takes it: a shared space may sample it for all
    return kw, opt


def make_pruner(
    pruner: str, eval_every: int, steps: int, reduction: int
) -> optuna.pruners.BasePruner:
    if pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=eval_every, reduction_factor=reduction
        )
    if pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=eval_every, max_resource=steps, reduction_factor=reduction
        )
    if pruner == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"pruner must be one of {', '.join(PRUNERS)}, got {pruner!r}")


def _one_input(data: Dataset, idx: torch.Tensor) -> Any:
    named = {k: v[idx] for k, v in data.inputs.items()}
    # One input travels as a plain tensor: the worker gives it to the model's only input.
    return next(iter(named.values())) if len(named) == 1 else named


def holdout(data: Dataset, fraction: float) -> tuple[Dataset, Dataset]:
    """The first rows to train on and the last `fraction` of them held out for evaluation."""
    held = max(1, round(data.rows * fraction))
    if not 0 < fraction < 1 or held >= data.rows:
        raise ValueError(f"holdout must leave rows on both sides, got {fraction} of {data.rows}")
    cut = data.rows - held
    train = dataclasses.replace(
        data, inputs={k: v[:cut] for k, v in data.inputs.items()}, targets=data.targets[:cut]
    )
    test = dataclasses.replace(
        data,
        inputs={k: v[cut:] for k, v in data.inputs.items()},
        targets=data.targets[cut:],
        source=f"{data.source} held out",
    )
    return train, test


class _Display:
    """The live table of trials on stderr: rich.live when rich is importable, else one line per
    change of a trial (its state, or a new evaluation)."""

    def __init__(self, trials: list[TrialRecord], objective: str, enabled: bool) -> None:
        self.trials, self.objective, self.enabled = trials, objective, enabled
        self._live: Any = None
        self._seen: dict[int, tuple[str, int]] = {}
        if not enabled:
            return
        try:
            from rich.console import Console
            from rich.live import Live
        except ImportError:
            return
        self._live = Live(self._render(), console=Console(stderr=True), refresh_per_second=4)
        self._live.start()

    def _render(self) -> Any:
        from rich.table import Table

        table = Table(title="sweep")
        for col in ["trial", "params", "step", "last loss", self.objective, "state"]:
            table.add_column(col)
        for t in self.trials:
            table.add_row(*_row(t))
        return table

    def update(self, t: TrialRecord) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(self._render())
            return
        mark = (t.state, len(t.evals))
        if self._seen.get(t.number) != mark:
            self._seen[t.number] = mark
            print("trial " + "  ".join(_row(t)), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()
            self._live = None


Callback = Callable[[TrialRecord], Awaitable[None] | None]
JOURNAL_PREFIX = "journal:"
FINISHED = (
    optuna.trial.TrialState.COMPLETE,
    optuna.trial.TrialState.PRUNED,
    optuna.trial.TrialState.FAIL,
)


def open_storage(
    url: str, *, heartbeat_interval: int = 5, grace_period: int | None = None, retries: int = 3
) -> optuna.storages.BaseStorage:
    """The Optuna storage named by `url`: `journal:PATH` is a journal file (JournalFileBackend),
    anything else an SQLAlchemy URL (RDBStorage) with heartbeats every `heartbeat_interval`
    seconds, a trial with no beat for `grace_period` seconds (default twice the interval) failed
    and retried up to `retries` times. A bad URL or an unreachable database raises ValueError
    naming it, after at most 10 s of connecting, and so does a grace period no longer than the
    interval (every live trial would look dead between two of its beats)."""
    if grace_period is not None and grace_period <= heartbeat_interval:
        raise ValueError(
            f"a grace period of {grace_period} s is no longer than the heartbeat interval "
            f"({heartbeat_interval} s): live trials would be failed as dead"
        )
    if url.startswith(JOURNAL_PREFIX):
        from optuna.storages.journal import JournalFileBackend

        path = url.removeprefix(JOURNAL_PREFIX)
        try:
            return optuna.storages.JournalStorage(JournalFileBackend(path))
        except OSError as exc:
            raise ValueError(f"storage {url!r}: {exc}") from None
    import sqlalchemy.exc

    try:
        dialect = sqlalchemy.engine.make_url(url).get_backend_name()
    except sqlalchemy.exc.ArgumentError:
        raise ValueError(
            f"storage {url!r}: not an SQLAlchemy URL (sqlite:///PATH, "
            "postgresql+psycopg://USER@HOST/DB) nor journal:PATH"
        ) from None
    # Bounded connects: an unreachable server is an error in seconds, never a hang.
    connect = {"postgresql": {"connect_timeout": 10}, "sqlite": {"timeout": 10}}.get(dialect, {})
    attempts = 5
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(
                url,
                engine_kwargs={"connect_args": connect},
                heartbeat_interval=heartbeat_interval,
                grace_period=grace_period,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=retries
                ),
            )
        except (sqlalchemy.exc.SQLAlchemyError, ImportError) as exc:
            # Drivers started together race to create the tables: the loser finds them made
            # (PostgreSQL may say so as a unique violation in its catalogue).
            race = "already exists" in str(exc) or isinstance(exc, sqlalchemy.exc.IntegrityError)
            if attempt < attempts - 1 and race:
                time.sleep(0.1 * (attempt + 1))  # the other is still creating tables
                continue
            raise ValueError(f"storage {url!r}: {str(exc).splitlines()[0]}") from None
    raise AssertionError("unreachable")


def _finished(trials: list[optuna.trial.FrozenTrial]) -> int:
    """Finished trials of the study, less the failed ones enqueued again (their retry counts)."""
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback
    retried = {retry.retried_trial_number(t) for t in trials}
    return sum(t.state in FINISHED and t.number not in retried for t in trials)


async def sweep_async(
    client: Trains,
    *,
    name: str,
    factory: str | None = None,
    space: Mapping[str, Mapping[str, Any]],
    data: Dataset,
    trials: int,
    steps: int,
    eval_every: int,
    eval_data: Dataset | None = None,
    holdout_fraction: float = 0.2,
    objective: str = "loss",
    direction: str | None = None,
    pruner: str = "successive_halving",
    reduction_factor: int = 3,
    concurrency: int = 2,
    kwargs: Mapping[str, Any] | None = None,
    optimizer: Mapping[str, Any] | None = None,
    loss: str = "cross_entropy",
    batch: int = 16,
    seed: int = 0,
    chunk_bytes: int | None = None,
    pipeline: int | Literal["auto"] = 0,
    hf: str | None = None,
    out_dir: str | Path | None = None,
    show: bool = True,
    on_trial_end: Callback | None = None,
    timeout: float = 600.0,
    storage: str | None = None,
    heartbeat_interval: int = 5,
    grace_period: int | None = None,
    retries: int = 3,
    idle_close: float | None = 300.0,
) -> SweepResult:
    """A hyper-parameter sweep of `factory` through the mesh with Optuna (ask-and-tell) and its
    pruners: `trials` trials of `steps` steps of `batch` rows of `data`, `concurrency` at a time,
    each evaluated every `eval_every` steps; returns every trial's record and the Optuna study.

    `space` maps names to distributions, e.g. {"lr": {"type": "float", "low": 1e-4, "high":
    0.1, "log": True}}; a sampled value goes to the optimizer (`optimizer`, `lr`,
    `weight_decay`, `momentum`, `optim.<key>`) or else to the factory's keyword of that name,
    over the fixed `kwargs` / `optimizer` (see `client_sdk.sweep`). The objective is the
    held-out loss ("loss") or an evaluation metric ("accuracy"), minimized, or maximized for
    "accuracy" unless `direction` says otherwise. `eval_data` is held out for evaluations;
    without it the last `holdout_fraction` of `data` is. `pruner`: "successive_halving",
    "hyperband" or "none", with `reduction_factor`. `seed` seeds the sampler (trial
    parameters) and every trial's initial weights, so trials differ only by their parameters.
    `out_dir` receives trials.json and curves.png; `show` draws the live table on stderr.
    `pipeline`: each trial's job over that many workers, or "auto" (`train_open(pipeline=...)`).
    `hf`: a Hugging Face model directory in place of `factory`, every trial starting from its
    weights (`seed` then seeds each trial's random stream); its space then holds optimizer
    settings only.
    `timeout` bounds each call of a trial, not the sweep. `on_trial_end(record)` runs after a
    trial's job is closed, on the client's event loop (the blocking `Client`'s loop thread: it
    must not call that `Client`).

    `storage` (see `open_storage`) shares the study `name` with every driver given the same
    storage: `trials` then counts the study's finished trials, whoever ran them, and this
    driver's result holds the trials it ran. `heartbeat_interval`, `grace_period` and `retries`
    set how a dead driver's running trials are found, failed and retried (RDB storages).
    `idle_close`: each trial's job is closed by the broker once idle that many seconds
    (`train_open(idle_close=...)`): a driver that dies leaves no job holding the mesh's memory,
    whatever its storage (None: kept until closed)."""
    if trials < 1 or steps < 1 or not 1 <= eval_every <= steps or concurrency < 1:
        raise ValueError("trials, steps, concurrency need >= 1 and eval_every in 1..steps")
    if (factory is None) == (hf is None):
        raise ValueError("sweep needs factory='module:callable' or hf= a model directory")
    if hf is not None:
        model_keys, _ = split_params(dict.fromkeys(space), kwargs or {}, {})
        if model_keys:
            raise ValueError(
                f"sweep(hf=...): {sorted(model_keys)} would be the model's keyword arguments; "
                "a Hugging Face directory takes none (its space: optimizer settings)"
            )
    # The data's tensors brought torch in already; the SDK's import leaves it out (the CLI's
    # calls without tensors start without it: `client_sdk.connection.is_tensor`).
    import torch

    dists = {k: distribution(k, v) for k, v in space.items()}
    if show:
        # Optuna logs every trial to stderr, which would tear the live table apart.
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    direction = direction or ("maximize" if objective == "accuracy" else "minimize")
    if eval_data is None:
        data, eval_data = holdout(data, holdout_fraction)
    store = (
        None
        if storage is None
        else open_storage(
            storage,
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            retries=retries,
        )
    )
    beats = isinstance(store, optuna.storages.RDBStorage)
    # Trials this driver found stale (their driver dead): their mesh jobs, left open by the dead
    # driver, are closed here so that their memory goes back to the mesh's other jobs.
    stale: list[int] = []
    if beats:
        retry = store.get_heartbeat_stale_trial_callback()  # type: ignore[union-attr]

        def note_stale(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
            stale.append(trial.number)
            if retry is not None:
                retry(study, trial)

        store.heartbeat_stale_trial_callback = note_stale  # type: ignore[union-attr]
    study = optuna.create_study(
        storage=store,
        study_name=name,
        direction=direction,
        load_if_exists=store is not None,
        # Drivers sharing a study each draw their own parameters: one seed would have them all
        # sample the same points. Seeded by the OS then, not by the pid, which drivers in
        # containers or on other hosts often share (1 in a container).
        sampler=optuna.samplers.TPESampler(seed=seed if store is None else None),
        pruner=make_pruner(pruner, eval_every, steps, reduction_factor),
    )
    running: set[int] = set()  # this driver's trials' ids in the storage, for heartbeats
    seen: set[int] = set()  # other drivers' running trials, given one heartbeat each
    fixed_opt = dict(optimizer or {"name": "adamw", "lr": 1e-3})
    records: list[TrialRecord] = []
    display = _Display(records, objective, show)
    gate = asyncio.Semaphore(concurrency)
    eval_idx = torch.arange(eval_data.rows)
    eval_x, eval_y = _one_input(eval_data, eval_idx), eval_data.targets
    # The broker's UNAVAILABLE answer to a job opening before any job opened: the mesh takes no
    # training jobs, so no trial can run and the sweep is refused with that answer.
    refused: list[FlowmeshError] = []
    opened = False

    def next_move() -> str:
        """What a free slot does: ask a trial, wait for others' running trials (one may die and
        be retried), or stop, the study having its `trials` finished."""
        if beats:
            # A driver that died between asking a trial and its first heartbeat left a trial that
            # no staleness test sees: one heartbeat for it at first sight makes it go stale in
            # `grace_period` if its driver is dead (a live one's own heartbeats carry on).
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                if t._trial_id not in running and t._trial_id not in seen:
                    seen.add(t._trial_id)
                    store.record_heartbeat(t._trial_id)  # type: ignore[union-attr]
            optuna.storages.fail_stale_trials(study)
        all_trials = study.get_trials(deepcopy=False)
        done = _finished(all_trials)
        waiting = sum(t.state == optuna.trial.TrialState.WAITING for t in all_trials)
        live = sum(t.state == optuna.trial.TrialState.RUNNING for t in all_trials)
        if done >= trials:
            return "stop"
        if waiting or done + live < trials:
            return "ask"
        # Without heartbeats a dead driver's trial never ends: do not wait on others then.
        return "wait" if beats and live > len(running) else "stop"

    def beat(trial_id: int) -> None:
        """One heartbeat; a storage error is warned of, never raised: the next beat tries again
        (one lost beat is within the grace period), and a trial's training goes on."""
        try:
            store.record_heartbeat(trial_id)  # type: ignore[union-attr]
        except Exception as exc:  # the storage's (SQLAlchemy's, the driver's) own errors
            warnings.warn(f"sweep {name!r}: a heartbeat failed, tried again: {exc}", stacklevel=1)

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(heartbeat_interval)
            for trial_id in list(running):
                beat(trial_id)

    async def close_stale() -> None:
        while stale:
            job = f"{name}-t{stale.pop()}"
            msg = p.TrainClose(id=client.connection.next_id(), job=job, timeout_ms=10_000)
            try:
                await client.connection.call(msg, 10)
            except FlowmeshError as exc:
                # Not on this mesh (its driver used another), or closed already.
                if exc.code != Code.MODEL_NOT_FOUND:
                    warnings.warn(f"closing {job!r}, a dead driver's job: {exc}", stacklevel=1)

    async def driver() -> None:
        while not (refused and not opened):
            move = next_move()
            await close_stale()
            if move == "stop":
                return
            if move == "wait":
                await asyncio.sleep(heartbeat_interval)
                continue
            await run_trial()

    async def run_trial() -> None:
        nonlocal opened
        async with gate:
            if refused and not opened:
                return
            # Asked only once a slot is free, so the sampler sees every trial told before.
            trial = study.ask(dists)
            running.add(trial._trial_id)
            if beats:
                beat(trial._trial_id)
            rec = TrialRecord(trial.number, dict(trial.params), f"{name}-t{trial.number}")
            records.append(rec)
            records.sort(key=lambda r: r.number)
            kw, opt = split_params(trial.params, kwargs or {}, fixed_opt)
            t0 = time.perf_counter()
            rec.state = "RUNNING"
            display.update(rec)
            job = None
            state, value = optuna.trial.TrialState.FAIL, None
            try:
                job = await client.train_open(
                    rec.job,
                    factory,
                    hf=hf,
                    kwargs=kw,
                    # A directory brings its weights: the seed is the trial's random stream's.
                    seed=None if hf else seed,
                    rng_seed=seed if hf else None,
                    optimizer=opt,
                    loss=loss,
                    batch_size=batch,
                    chunk_bytes=chunk_bytes,
                    pipeline=pipeline,
                    # A diverged step comes back as a loss to prune on, not as an error.
                    stop_on_nonfinite=False,
                    timeout=timeout,
                    idle_close=idle_close,
                )
                opened = True
                rec.workers = list(job.info.pipeline) or [job.info.worker]
                state, value = await _train(job, rec, trial)
            except (FlowmeshError, ValueError) as exc:
                if isinstance(exc, FlowmeshError) and exc.code == Code.UNAVAILABLE and job is None:
                    refused.append(exc)
                rec.reason = str(exc)
            finally:
                if job is not None:
                    # At once, pruned or not: its training memory goes to the trials still running.
                    try:
                        await job.close(timeout=timeout)
                    except FlowmeshError as exc:
                        rec.reason = rec.reason or f"close: {exc}"
            rec.value = value
            rec.state = state.name
            rec.seconds = time.perf_counter() - t0
            running.discard(trial._trial_id)
            try:
                study.tell(trial, value, state=state)
            except Exception as exc:
                # Another driver failed it as stale (its beats came late: a stalled loop or
                # storage), and retried it as a new trial; or the storage failed. Either way
                # this driver's part is over: noted, and the sweep goes on.
                rec.state = "FAIL"
                rec.reason = rec.reason or f"not recorded: {exc}"
                warnings.warn(f"sweep {name!r}: trial {trial.number}: {exc}", stacklevel=1)
            display.update(rec)
        if on_trial_end is not None:
            res = on_trial_end(rec)
            if inspect.isawaitable(res):
                await res

    async def _train(
        job: Any, rec: TrialRecord, trial: optuna.Trial
    ) -> tuple[optuna.trial.TrialState, float | None]:
        value: float | None = None
        for i in range(steps):
            idx = torch.arange(i * batch, (i + 1) * batch) % data.rows
            res = await job.step_async(_one_input(data, idx), data.targets[idx], timeout=timeout)
            rec.curve.append(res.loss)
            rec.step = res.step
            if not math.isfinite(res.loss) or res.metrics.get("nonfinite"):
                rec.reason = "diverged"
                return optuna.trial.TrialState.PRUNED, None
            display.update(rec)
            if rec.step % eval_every == 0 or rec.step == steps:
                ev = await job.eval_async(eval_x, eval_y, timeout=timeout)
                if objective == "loss":
                    value = ev.loss
                elif objective in ev.metrics:
                    value = ev.metrics[objective]
                else:
                    raise ValueError(f"the evaluation has no metric {objective!r}")
                if not math.isfinite(value):
                    rec.reason = "diverged"
                    return optuna.trial.TrialState.PRUNED, None
                rec.evals.append((rec.step, value))
                trial.report(value, rec.step)
                display.update(rec)
                if rec.step < steps and trial.should_prune():
                    return optuna.trial.TrialState.PRUNED, None
        return optuna.trial.TrialState.COMPLETE, value

    beating = asyncio.create_task(heartbeat()) if beats else None
    try:
        # A task group: one that raises cancels the others (whose jobs their `finally` closes),
        # where a gather left them training on after the sweep had returned.
        async with asyncio.TaskGroup() as group:
            if store is None:  # alone on its study: exactly `trials` trials
                for _ in range(trials):
                    group.create_task(run_trial())
            else:
                for _ in range(min(concurrency, trials)):
                    group.create_task(driver())
    except BaseExceptionGroup as group_exc:
        raise group_exc.exceptions[0] from None  # as the gather raised: the first error
    finally:
        if beating is not None:
            beating.cancel()
        display.close()
    if refused and not opened:
        raise refused[0]
    result = SweepResult(name, objective, direction, records, study)
    if out_dir is not None:
        save(result, Path(out_dir))
    if show:
        print(result.table(), flush=True)
    return result


def save(result: SweepResult, out_dir: Path) -> None:
    """trials.json and curves.png into `out_dir` (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    result.out_dir = out_dir
    (out_dir / "trials.json").write_text(json.dumps(result.to_json(), indent=2))
    plot(result, out_dir / "curves.png")


def plot(result: SweepResult, path: Path) -> None:
    """Every trial's training loss per step and its evaluations under one legend: pruned trials
    dashed and marked where stopped, an outlier trial clipped off the axis (`sweep_plot`)."""
    sweep_plot.plot(result.name, result.objective, result.trials, path)
