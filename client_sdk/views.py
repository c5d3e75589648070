"""What the `flowmesh` command shows: the broker's status, training jobs, plans and deploys as
text tables, the live view of `status --watch`, and the progress bars of deploy and train.

Everything here renders; nothing talks to the broker (client_sdk/cli.py does). Sizes are shown in
binary units (MiB, GiB) everywhere, as `flowmesh.units.fmt_bytes` writes them.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from flowmesh.reports import BrokerStatus, JobRow, ModelRow, SubModelRow
from flowmesh.units import fmt_bytes


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header, *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_status(st: BrokerStatus) -> str:
    totals = st.totals
    out = [
        f"broker up {st.uptime_s:.0f} s  protocol v{st.protocol}  "
        f"requests {totals.requests}  completed {totals.completed}  errors {totals.errors}  "
        f"queued {st.queued}  running batches {st.inflight_batches}",
        "",
    ]
    if totals.direct_batches or totals.activation_bytes_relayed:
        out.insert(
            1,
            f"stages over several workers: {totals.direct_batches} batches direct, "
            f"{fmt_bytes(totals.activation_bytes_relayed)} of activations relayed",
        )
    rows = [
        [
            w.name,
            w.device,
            "ready" if w.ready else "joining",
            fmt_bytes(w.budget_bytes),
            fmt_bytes(w.resident_bytes),
            fmt_bytes(w.peak_bytes),
            fmt_bytes(w.host_bytes),
            w.loads,
            fmt_bytes(w.load_bytes),
            f"{w.mean_load_ms:.1f}",
            w.evictions,
            w.inflight,
            ", ".join(w.resident) or "-",
        ]
        for w in st.workers
    ]
    out.append(
        table(
            rows,
            [
                "worker",
                "device",
                "state",
                "budget",
                "resident",
                "peak",
                "host",
                "loads",
                "loaded",
                "load ms",
                "evictions",
                "running",
                "resident stages",
            ],
        )
    )
    parts = (
        ", ".join(f"{p.name} ({'ready' if p.ready else 'joining'})" for p in st.partitioners)
        or "none"
    )
    for w in st.workers:
        t = w.stats  # its heartbeat figures
        if t.train_budget_bytes:
            # Pipelined stages stay resident: their parameters and optimizer state in arena
            # ranges held for their jobs' lives (not in the tasks' resident bytes), their
            # gradients and activations made per step beside it.
            piped = ""
            if t.pipe_stages:
                piped = (
                    f"; pipelined stages {t.pipe_stages} holding {fmt_bytes(t.pipe_bytes)} "
                    f"({fmt_bytes(t.training_held)} of the arena held)"
                )
            stashes = ""
            if t.train_stash_device_limit:
                stashes = (
                    f"; stashes on the device {fmt_bytes(t.train_stash_device_bytes)} "
                    f"(peak {fmt_bytes(t.train_stash_device_peak)}) of "
                    f"{fmt_bytes(t.train_stash_device_limit)}, "
                    f"{fmt_bytes(t.train_stash_host_bytes)} to the host tier"
                )
            out.append(
                f"{w.name} training: resident {fmt_bytes(t.train_resident_bytes)} "
                f"(peak {fmt_bytes(t.train_resident_peak)}) of "
                f"{fmt_bytes(t.train_budget_bytes)}, tasks {t.train_tasks}, "
                f"job switches {t.train_job_switches}{stashes}{piped}"
            )
        if w.kv_limit_bytes:  # a worker with a language model's stages
            out.append(
                f"{w.name} KV cache: {fmt_bytes(w.kv_bytes)} of {fmt_bytes(w.kv_limit_bytes)} "
                f"({w.kv_blocks} blocks, {w.kv_seqs} sequences)"
                + (f", {w.kv_blocks_free} blocks free" if t.kv_blocks_free is not None else "")
            )
    out += ["", f"partitioners: {parts}", ""]
    rows = []
    for m in st.models:
        stages = " | ".join(
            f"{s.blocks[0]}-{s.blocks[1] - 1}:{fmt_bytes(s.bytes)}" for s in m.stages
        )
        reps = "; ".join(
            "+".join(r.workers) + ("" if r.live else " (deploying)") for r in m.replicas
        )
        rows.append(
            [
                m.name,
                m.state,
                fmt_bytes(m.bytes),
                stages,
                reps,
                m.queue,
                m.requests,
                m.errors,
                m.loads,
                m.evictions,
                f"{m.mean_ms:.1f}",
                f"{m.p99_ms:.1f}",
                f"{m.queue_wait_ms:.1f}",
                f"{m.load_wait_ms:.1f}",
                f"{m.run_ms:.1f}",
                f"{m.mean_batch:.1f}",
            ]
        )
    out.append(
        table(
            rows,
            [
                "model",
                "state",
                "bytes",
                "stages (blocks:bytes)",
                "replicas",
                "queue",
                "requests",
                "errors",
                "loads",
                "evictions",
                "mean ms",
                "p99 ms",
                "queue ms",
                "load wait ms",
                "run ms",
                "batch",
            ],
        )
    )
    generating = [m for m in st.models if m.gen_iterations or m.running_seqs or m.waiting_seqs]
    if generating:
        out.append("")
    for m in generating:
        out.append(
            f"{m.name} generation: {m.running_seqs} sequences running, {m.waiting_seqs} "
            f"waiting, {m.tokens_generated} tokens in {m.gen_iterations} iterations"
            + (
                f", {m.preemptions} preemptions ({m.swaps} resumed from parked KV, "
                f"{m.recomputes} recomputed)"
                if m.preemptions
                else ""
            )
            + (f", {m.restarts} restarts" if m.restarts else "")
        )
        if m.tokens_generated:
            out.append(
                f"{m.name} tokens: {m.tokens_per_s:.1f}/s, first token p50 "
                f"{_ms(m.ttft_p50_ms)} ms p99 {_ms(m.ttft_p99_ms)} ms, between tokens p50 "
                f"{_ms(m.itl_p50_ms)} ms p99 {_ms(m.itl_p99_ms)} ms"
            )
    if st.jobs:
        out += ["", format_jobs(st.jobs)]
    return "\n".join(out)


def _moved(j: JobRow) -> str:
    """What a job's last step copied into the device arena / wrote back to the host tier."""
    if not j.step_bytes_in and not j.step_bytes_out:
        return "-"
    return f"{fmt_bytes(j.step_bytes_in)}/{fmt_bytes(j.step_bytes_out)}"


def _sub_model(m: SubModelRow) -> str:
    """A sub-model's cell: blocks:host/task bytes, then its activation policy if reported."""
    cell = f"{m.blocks[0]}-{m.blocks[1] - 1}:{fmt_bytes(m.host_bytes)}/{fmt_bytes(m.task_bytes)}"
    return f"{cell} {m.activations}" if m.activations else cell


def _where(j: JobRow) -> str:
    """A job's worker, or its stages' workers in stage order ("+": as a replica's)."""
    return "+".join(j.pipeline) if j.pipeline else j.worker


def format_jobs(jobs: list[JobRow]) -> str:
    """Training jobs as a table: worker (a pipelined job's stages' workers), state, step, last
    loss, steps/s, samples/s (and tokens/s for a language model's job), what the last step
    moved (into the arena / back to the host tier) and waited for memory, the sub-models with
    their activation policies (as of the last answered step), and what the forward computes
    in."""
    rows = [
        [
            j.name,
            _where(j),
            j.state,
            j.step,
            "-" if j.last_loss is None else f"{j.last_loss:.4g}",
            f"{j.steps_per_s:.2f}",
            f"{j.samples_per_s:.1f}" + (f" ({j.tokens_per_s:.0f} tok/s)" if j.tokens else ""),
            _moved(j),
            f"{j.step_memory_wait_s * 1000:.1f} ms",
            " | ".join(_sub_model(m) for m in j.sub_models) or "-",
            # What its forward computes in (mixed precision: bfloat16 over float32 weights).
            j.config.compute_dtype if j.config is not None else "float32",
            fmt_bytes(j.footprint),
            "-" if j.saved_step is None else j.saved_step,
            j.pending,
            j.errors,
        ]
        for j in jobs
    ]
    header = [
        "job",
        "worker",
        "state",
        "step",
        "loss",
        "steps/s",
        "samples/s",
        "moved/step (in/out)",
        "mem wait/step",
        "sub-models (blocks:host/task bytes activations)",
        "dtype",
        "footprint",
        "saved",
        "pending",
        "errors",
    ]
    return table(rows, header)


def format_plan(plan: dict[str, Any]) -> str:
    from flowmesh.modelio.plan import Plan

    return Plan.from_dict(plan).table()


def format_deployed(info: ModelRow) -> str:
    """The one line `flowmesh deploy` prints once the model is deployed."""
    stages = ", ".join(
        f"stage {s.index}: blocks {s.blocks[0]}-{s.blocks[1] - 1} ({fmt_bytes(s.bytes)})"
        for s in info.stages
    )
    reps = "; ".join("+".join(r.workers) for r in info.replicas)
    return f"deployed {info.name}: {fmt_bytes(info.bytes)}, {stages}; replicas: {reps}"


def format_infer(outs: dict[str, Any], info: dict[str, Any], rows: int) -> str:
    """What `flowmesh infer` prints: each output's dtype, shape and moments, then the broker's
    account. `rows` is this request's batch (dim 0); the broker's `batch` counts the requests it
    ran together with this one."""
    lines = [
        f"{name or 'output'}: {t.dtype} {list(t.shape)} mean {t.float().mean():.6f} "
        f"std {t.float().std():.6f}"
        for name, t in outs.items()
    ]
    together = int(info["batch"])
    lines.append(
        f"latency {info['latency_ms']:.1f} ms (queue {info['queue_ms']:.1f}, compute "
        f"{info['compute_ms']:.1f}, waiting for weights {info['load_wait_ms']:.1f}), batch of "
        f"{rows} row(s) in a forward of {together} request(s), workers "
        f"{', '.join(info['workers'])}"
    )
    return "\n".join(lines)


# -- status --watch ---------------------------------------------------------------------------
# Few, short columns so that the view fits 80 columns; `flowmesh status` has every figure.


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _watch_head(st: BrokerStatus) -> list[str]:
    totals = st.totals
    return [
        f"broker up {st.uptime_s:.0f} s  requests {totals.requests}  completed "
        f"{totals.completed}  errors {totals.errors}",
        f"queued {st.queued}  running batches {st.inflight_batches}  dropped sends "
        f"{totals.dropped_sends}",
    ]


def _watch_tables(st: BrokerStatus) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of each table of the watch view."""
    workers = [
        [
            w.name,
            "ready" if w.ready else "joining",
            fmt_bytes(w.resident_bytes),
            fmt_bytes(w.budget_bytes),
            str(len(w.resident)),
            str(w.loads),
            str(w.evictions),
            str(w.inflight),
            f"{w.last_seen_s:.1f}",
        ]
        for w in st.workers
    ]
    models = [
        [
            m.name,
            m.state,
            str(len(m.replicas)),
            str(m.queue),
            str(m.requests),
            str(m.errors),
            _ms(m.mean_ms),
            _ms(m.p99_ms),
            _ms(m.load_wait_ms),
            f"{m.mean_batch:.1f}",
        ]
        for m in st.models
    ]
    out = [
        (
            "workers",
            ["worker", "state", "resident", "budget", "stages", "loads", "evict", "run", "seen s"],
            workers,
        ),
        (
            "models (times in ms)",
            ["model", "state", "repl", "queue", "req", "err", "mean", "p99", "load", "batch"],
            models,
        ),
    ]
    if st.jobs:
        jobs = [
            [
                j.name,
                _where(j),
                j.state,
                str(j.step),
                "-" if j.last_loss is None else f"{j.last_loss:.4g}",
                f"{j.steps_per_s:.2f}",
                str(j.pending),
                str(j.errors),
            ]
            for j in st.jobs
        ]
        # 80 columns hold no more: samples/s, copies and memory waits are in `flowmesh jobs`
        # and `flowmesh status`.
        header = ["job", "worker", "state", "step", "loss", "steps/s", "pending", "errors"]
        out.append(("training jobs", header, jobs))
    return out


def watch_text(st: BrokerStatus | None, note: str = "") -> str:
    """One snapshot of `status --watch` as plain text (its output when not on a terminal)."""
    if st is None:
        return note or "waiting for the broker"
    head = _watch_head(st)
    if note:
        head.append(f"({note})")
    parts = ["\n".join(head)]
    for title, header, rows in _watch_tables(st):
        parts.append(f"{title}\n{table(rows, header)}")
    return "\n\n".join(parts)


def status_view(st: BrokerStatus | None, note: str = "") -> Any:
    """The live view of `status --watch` on a terminal (rich): the same tables as `watch_text`,
    coloured."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if st is None:
        return Text(note or "waiting for the broker", style="yellow")
    head = Text("\n".join(_watch_head(st)))
    if note:
        head.append(f"\n({note})", style="yellow")
    parts: list[Any] = [head]
    for title, header, rows in _watch_tables(st):
        # No borders: two spaces between columns, as the plain text has, so that both fit.
        t = Table(title=title, title_justify="left", box=None, padding=(0, 1), pad_edge=False)
        for col in header:
            t.add_column(col, no_wrap=True)
        for row in rows:
            cells = [Text(c) for c in row]
            for i, col in enumerate(header):
                if col == "state":
                    cells[i].stylize("green" if row[i] in ("ready", "running") else "yellow")
                elif col in ("err", "errors") and row[i] != "0":
                    cells[i].stylize("red")
            t.add_row(*cells)
        parts.append(t)
    return Group(*parts)


# -- progress of deploy and train -------------------------------------------------------------


class DeployWatch:
    """How far a deploy's weights are read, from the workers' heartbeats in status (each
    reports `preparing`: "model/stage" -> [bytes read, bytes to read] while it reads)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stages: dict[tuple[str, str], list[int]] = {}  # (worker, stage) -> [read, total]

    def update(self, status: BrokerStatus) -> tuple[int, int]:
        """(bytes read, bytes to read) so far; a stage no longer reported has been read."""
        now = set()
        for w in status.workers:
            for key, value in w.stats.preparing.items():
                model, _, stage = key.rpartition("/")
                if model == self.name and len(value) == 2:
                    self.stages[(w.name, stage)] = [int(value[0]), int(value[1])]
                    now.add((w.name, stage))
        for key, value in self.stages.items():
            if key not in now:
                value[0] = value[1]
        return sum(v[0] for v in self.stages.values()), sum(v[1] for v in self.stages.values())


def deploy_bar(name: str) -> Any:
    """The bar of a deploy's weights read so far, on stderr, its sizes and rate in binary units
    (rich's own download columns write decimal MB, unlike every other size flowmesh prints)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Bytes(ProgressColumn):
        def render(self, task: Any) -> Text:
            total = "?" if task.total is None else fmt_bytes(task.total)
            speed = "" if task.speed is None else f"  {fmt_bytes(task.speed)}/s"
            return Text(f"{fmt_bytes(task.completed)} / {total}{speed}")

    return Progress(
        TextColumn(f"[bold]deploy {name}: reading weights"),
        BarColumn(),
        Bytes(),
        TimeElapsedColumn(),
        console=Console(stderr=True),  # outside a terminal: the final state only
    )


class TrainProgress:
    """Steps done, steps/s and the last loss on stderr (stdout keeps the summary): a rich
    progress bar when rich is installed, else one line rewritten in place."""

    def __init__(self, total: int, name: str) -> None:
        self.total, self.name = total, name
        self.t0 = time.perf_counter()
        self._bar: Any = None
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )
        except ImportError:
            return
        self._bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} steps/s  loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self._task = self._bar.add_task(name, total=total, rate="-", loss="-")
        self._bar.start()

    def update(self, done: int, loss: float) -> None:
        rate = f"{done / max(time.perf_counter() - self.t0, 1e-9):.2f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=done, rate=rate, loss=f"{loss:.4f}")
        else:
            line = f"\r{self.name}: step {done}/{self.total}  {rate} steps/s  loss {loss:.4f}"
            print(line, end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.total < 0:
            return
        self.total = -1  # closed: a second close (the error path) prints nothing more
        if self._bar is not None:
            self._bar.stop()
        else:
            print(file=sys.stderr, flush=True)
