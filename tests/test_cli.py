"""The `flowmesh` command without a mesh: what `up` builds, what `status` and the watch view
print, its version, and how it refuses what it does not understand (run as a user runs it)."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from client_sdk import cli, cli_args, views
from client_sdk.cli import build_parser, up_mesh
from client_sdk.client import Client
from flowmesh.reports import BrokerStatus, Totals
from tests.support.cli import ROOT, flowmesh
from tests.support.ports import free_port
from tests.support.reports import broker_status, job_row, model_row, replica_row, worker_row


def test_up_passes_state_dir_and_autoscale_to_the_broker() -> None:
    args = build_parser().parse_args(
        ["up", "--cpu-workers", "3", "--state-dir", "/tmp/s", "--autoscale", "--listen", ":7000"]
    )
    mesh = up_mesh(args, gpus=[])
    assert mesh.broker_args == ["--state-dir", "/tmp/s", "--autoscale", "1"]
    assert (mesh.cpu_workers, mesh.frontend_port, mesh.backend_port) == (3, 7000, 7001)
    plain = up_mesh(build_parser().parse_args(["up", "--cpu-workers", "1"]), gpus=[])
    assert plain.broker_args == []  # autoscale stays off unless asked for


def test_status_says_how_activations_travelled_only_when_some_did() -> None:
    from client_sdk.cli import format_status

    st = broker_status(uptime_s=3, totals=Totals(requests=2, completed=2))
    assert "stages over several workers" not in format_status(st)
    st.totals.direct_batches, st.totals.activation_bytes_relayed = 5, 3 << 20
    line = format_status(st).splitlines()[1]
    assert line == "stages over several workers: 5 batches direct, 3.0 MiB of activations relayed"


def test_status_shows_generation_only_for_models_that_generate() -> None:
    from client_sdk.cli import format_status

    llm = model_row("llm", running_seqs=3, waiting_seqs=1, tokens_generated=40, gen_iterations=12)
    st = broker_status(models=[model_row("mlp"), llm])
    lines = [ln for ln in format_status(st).splitlines() if "generation:" in ln]
    assert lines == ["llm generation: 3 sequences running, 1 waiting, 40 tokens in 12 iterations"]


def test_metrics_carry_the_same_generation_figures() -> None:
    from flowmesh import metrics

    llm = model_row("llm", running_seqs=3, waiting_seqs=1, tokens_generated=40, gen_iterations=12)
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in metrics.broker_families(broker_status(models=[llm]))
        for s in f.samples
    }
    llm_label = (("model", "llm"),)
    assert got[("flowmesh_broker_running_sequences", llm_label)] == 3
    assert got[("flowmesh_broker_waiting_sequences", llm_label)] == 1
    assert got[("flowmesh_broker_generated_tokens_total", llm_label)] == 40
    assert got[("flowmesh_broker_generation_iterations_total", llm_label)] == 12


def test_version_is_the_installed_package_s() -> None:
    run = flowmesh("--version")
    assert run.returncode == 0, run.stderr
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert run.stdout == f"flowmesh {version('flowmesh')}\n" == f"flowmesh {declared}\n"


def test_a_mistyped_flag_shows_the_subcommand_s_usage_and_the_closest_flag() -> None:
    run = flowmesh("infer", "mlp", "--bacth", "2")
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("usage: flowmesh infer "), run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        "flowmesh infer: error: unrecognized arguments: --bacth 2 (did you mean --batch?)"
    )


def subparsers(ap: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`ap` and every (sub)command parser under it."""
    out = [ap]
    for action in ap._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                out += subparsers(p)
    return out


def test_no_parser_takes_an_abbreviated_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parsers = subparsers(build_parser())
    assert len(parsers) > 12 and all(not p.allow_abbrev for p in parsers)
    # A prefix of a flag is refused, with the flag it is a prefix of as the suggestion.
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["up", "--cpu-worker", "1"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --cpu-worker 1 (did you mean --cpu-workers?)" in err, err
    assert err.startswith("usage: flowmesh up "), err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heartbeat", "0"], "argument --heartbeat: expected a number over 0, got '0'"),
        (["--heartbeat", "nan"], "argument --heartbeat: expected a number over 0, got 'nan'"),
        (["--threads", "0"], "argument --threads: expected an integer of at least 1, got '0'"),
    ],
)
def test_up_refuses_values_its_mesh_could_never_run_with(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    # (--heartbeat 0 started a broker that spun a core while no peer could register, and up
    # waited its whole ready timeout, deaf to Ctrl-C.)
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["up", "--cpu-workers", "1", *argv])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err
    assert build_parser().parse_args(["up", "--heartbeat", "0.5"]).heartbeat == 0.5


def test_up_refuses_open_binds_without_keys_in_its_own_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The broker and the gateway refused them too, but only once started, in their logs, and
    # naming flags up does not take (--insecure 1, --insecure-open).
    monkeypatch.delenv("FLOWMESH_API_KEYS", raising=False)
    port = free_port()
    with pytest.raises(SystemExit) as refused:
        cli.main(["up", "--cpu-workers", "1", "--listen", f"0.0.0.0:{port}"])
    said = str(refused.value)
    assert said.startswith(f"flowmesh up: --listen 0.0.0.0:{port} is not a loopback address")
    assert said.endswith("or pass --insecure to run without keys anyway")
    gateway = ["--listen", f"127.0.0.1:{port}", "--http-port", str(free_port())]
    with pytest.raises(SystemExit) as refused:
        cli.main(["up", "--cpu-workers", "1", *gateway, "--http-host", "0.0.0.0"])
    said = str(refused.value)
    assert said.startswith("flowmesh up: the gateway's host 0.0.0.0 is not a loopback address")
    assert said.endswith("or pass --insecure to serve every caller")
    # With a key file in the config's [gateway] table, the gateway is keyed: not refused here.
    args = build_parser().parse_args(["up", *gateway, "--http-host", "0.0.0.0"])
    args.config = str(tmp_path / "flowmesh.toml")
    Path(args.config).write_text(f'[gateway]\napi_keys = "{tmp_path / "api_keys.json"}"\n')
    cli.refuse_open_binds(args, "127.0.0.1", "0.0.0.0")
    cli.refuse_open_binds(build_parser().parse_args(["up", "--insecure"]), "0.0.0.0", "0.0.0.0")


def test_up_names_the_metrics_port_in_use_not_the_listen_port() -> None:
    # (It used to say that --listen's free port was in use, the broker's log having the cause.)
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listen = f"127.0.0.1:{free_port()}"
        # The partitioner's: the second of the ports from --metrics-port on.
        argv = ["up", "--cpu-workers", "1", "--listen", listen, "--metrics-port", str(port - 1)]
        with pytest.raises(SystemExit) as refused:
            cli.main(argv)
    assert str(refused.value) == (
        f"flowmesh up: port {port} (the partitioner's /metrics: --metrics-port {port - 1} and "
        "the ports after it, one per process) is already in use; choose another --metrics-port"
    )


def test_input_mistakes_stop_a_command_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each was a Python traceback (an --output one only after the request had run); none
    # needs a broker to be found out.
    nobody = ["--broker", "tcp://127.0.0.1:9"]
    absent = tmp_path / "absent.safetensors"
    garbled = tmp_path / "garbled.safetensors"
    garbled.write_bytes(b"not safetensors")
    for argv, said in [
        (["infer", "m", "--input", str(absent)], f"flowmesh infer: --input {absent}: No such"),
        (["infer", "m", "--input", str(garbled)], f"flowmesh infer: --input {garbled}: "),
        (
            ["infer", "m", "--output", str(tmp_path / "no" / "o.safetensors")],
            f"flowmesh infer: --output {tmp_path / 'no' / 'o.safetensors'}: no writable directory",
        ),
        (["up", "--listen", "localhost"], "flowmesh up: --listen localhost: expected HOST:PORT"),
    ]:
        with pytest.raises(SystemExit) as refused:
            cli.main([*argv, *nobody] if argv[0] == "infer" else argv)
        assert str(refused.value).startswith(said), refused.value
    for argv, said in [
        (["infer", "m", "--batch", "-2"], "argument --batch: expected an integer of at least 1"),
        (["infer", "m", "--timeout", "0"], "argument --timeout: expected a number over 0"),
    ]:
        with pytest.raises(SystemExit) as refused:
            build_parser().parse_args(argv)
        assert refused.value.code == 2 and said in capsys.readouterr().err


def test_a_broker_on_a_state_dir_it_cannot_use_stops_with_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    run = subprocess.run(
        [sys.executable, "-m", "broker", "--state-dir", str(afile), "--frontend",
         f"tcp://127.0.0.1:{free_port()}", "--backend", f"tcp://127.0.0.1:{free_port()}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip() == f"python -m broker: --state-dir {afile}: [Errno 17] File " + (
        f"exists: '{afile}'"
    )


def test_plan_and_train_take_any_torch_optimizer_by_name() -> None:
    for cmd in ("plan", "train"):
        p = next(p for p in subparsers(build_parser()) if p.prog == f"flowmesh {cmd}")
        action = next(a for a in p._actions if a.dest == "optimizer")
        # No fixed list: the worker resolves the name in torch.optim (flowmesh.optimizers).
        assert action.choices is None and "torch.optim" in action.help


def test_up_hands_its_config_file_to_every_process_and_keeps_its_log_dir(tmp_path: Path) -> None:
    config = tmp_path / "flowmesh.toml"
    config.write_text("[broker]\nmax_queue = 7\n\n[worker]\ncompute_lanes = 1\n")
    argv = ["up", "--cpu-workers", "1", "--config", str(config), "--log-dir", str(tmp_path)]
    mesh = up_mesh(build_parser().parse_args(argv), gpus=[])
    given = ["--config", str(config)]
    assert mesh.broker_args == given and mesh.partitioner_args == mesh.worker_args == given
    assert mesh.run_dir == tmp_path
    cli.check_config(str(config))  # every table and key known
    config.write_text("[worker]\nmemory_budgte = 1\n")
    with pytest.raises(SystemExit) as refused:
        cli.check_config(str(config))
    assert str(refused.value) == (
        f"flowmesh up: {config}: [worker] memory_budgte: unknown key (did you mean memory_budget?)"
    )
    free = up_mesh(build_parser().parse_args(["up", "--listen", "127.0.0.1:0"]), gpus=[])
    assert (free.frontend_port, free.backend_port) == (0, 0)  # both chosen at bind


def test_infer_reports_the_request_s_rows_and_the_requests_batched_with_it() -> None:
    import torch

    info = {"latency_ms": 3.0, "queue_ms": 1.0, "compute_ms": 2.0, "load_wait_ms": 0.0}
    text = views.format_infer({"": torch.zeros(2, 3)}, {**info, "batch": 1, "workers": ["w"]}, 2)
    assert "batch of 2 row(s) in a forward of 1 request(s), workers w" in text, text


def test_the_deploy_bar_counts_in_mib() -> None:
    bar = views.deploy_bar("m")
    bar.add_task("read", total=3 << 20, completed=1 << 20)
    (task,) = bar.tasks
    assert str(bar.columns[2].render(task)) == "1.0 MiB / 3.0 MiB"


def status_of(workers: int, models: int, jobs: int) -> BrokerStatus:
    """A status as the broker sends it, with long names and figures."""
    return broker_status(
        uptime_s=86399, queued=4096, inflight_batches=12,
        totals=Totals(requests=1234567, completed=1234000, errors=567, dropped_sends=3),
        workers=[
            worker_row(
                f"gpu-worker-{i}", ready=i % 2 == 0, resident_bytes=70 << 30,
                budget_bytes=80 << 30, resident=[f"chat-large/{k}" for k in range(9)],
                loads=12345, evictions=9876, inflight=16, last_seen_s=123.4,
            )
            for i in range(workers)
        ],
        models=[
            model_row(
                f"chat-large-{i}", state="deploying", replicas=[replica_row()] * 3,
                queue=4096, requests=123456, errors=1234, mean_ms=12345.6,
                p99_ms=99999.9, load_wait_ms=1234.5, mean_batch=7.5,
            )
            for i in range(models)
        ],
        jobs=[
            job_row(
                f"train-12345-{i}", worker="gpu-worker-1", state="running",
                step=123456, last_loss=1.2345678, steps_per_s=123.45, pending=8,
                errors=0,
            )
            for i in range(jobs)
        ],
    )  # fmt: skip


def test_the_watch_view_fits_80_columns_on_a_terminal_and_as_text() -> None:
    from rich.console import Console

    st = status_of(workers=3, models=4, jobs=2)
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(views.status_view(st, note="no answer from tcp://10.0.0.1:5555"))
    drawn = console.file.getvalue()  # type: ignore[attr-defined]
    plain = views.watch_text(st)
    for text in (drawn, plain):
        assert max(len(line) for line in text.splitlines()) <= 80, text
        for title, header, _rows in views._watch_tables(st):
            # Every header whole on one line: nothing folded or cut short.
            line = next(ln for ln in text.splitlines() if ln.startswith(f"{header[0]} "))
            assert line.split() == " ".join(header).split(), line
            assert title in text
        assert "chat-large-3" in text and "train-12345-1" in text and "gpu-worker-2" in text
    assert "\x1b" not in plain


def test_up_binds_the_gateway_where_told_and_opens_it_only_with_insecure(tmp_path: Path) -> None:
    """--http-host, else the config's [gateway] host, else loopback; `up --insecure` opens the
    gateway to every caller too (the gateway itself refuses a non-loopback bind without keys
    or --insecure-open: tests/gateway/test_guard.py)."""
    from client_sdk.mesh import reachable

    def mesh(*argv: str) -> Any:
        return up_mesh(build_parser().parse_args(["up", "--http-port", "8000", *argv]), gpus=[])

    plain = mesh()
    assert (plain.http_port, plain.http_host, plain.gateway_args) == (8000, "127.0.0.1", [])
    wide = mesh("--http-host", "0.0.0.0", "--insecure")
    assert (wide.http_host, wide.gateway_args) == ("0.0.0.0", ["--insecure-open"])
    config = tmp_path / "flowmesh.toml"
    config.write_text('[gateway]\nhost = "::"\nport = 8100\n')
    from_file = up_mesh(build_parser().parse_args(["up", "--config", str(config)]), gpus=[])
    assert (from_file.http_port, from_file.http_host) == (8100, "::")
    assert mesh("--config", str(config), "--http-host", "::1").http_host == "::1"  # flag wins
    assert [reachable(h) for h in ("0.0.0.0", "::", "10.1.2.3", "::1")] == [
        "127.0.0.1",
        "[::1]",
        "10.1.2.3",
        "[::1]",
    ]


def test_ctrl_c_ends_a_command_with_130_and_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "generate", interrupted)
    assert cli.main(["generate", "lm", "hi", "--broker", "tcp://127.0.0.1:9"]) == 130
    err = capsys.readouterr().err
    assert err == "\nflowmesh generate: interrupted\n"


def test_pipeline_takes_a_number_of_stages_or_auto(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parse = build_parser().parse_args
    train = ["train", "m:f", "--steps", "1", "--pipeline"]
    assert parse([*train, "auto"]).pipeline == "auto"
    assert parse([*train, "3"]).pipeline == 3
    assert cli_args.pipeline_arg(" AUTO ") == "auto" and cli_args.pipeline_arg(2) == 2
    for value in (True, 2.5):  # a sweep TOML's
        with pytest.raises(argparse.ArgumentTypeError, match="a number of stages, or auto"):
            cli_args.pipeline_arg(value)
    for bad, why in (("some", "a number of stages, or auto"), ("65", "between 0 and 64")):
        with pytest.raises(SystemExit) as refused:
            parse([*train, bad])
        assert refused.value.code == 2 and why in capsys.readouterr().err
    # The SDK refuses it before sending anything.
    with Client("tcp://127.0.0.1:9", timeout=1) as c:
        for bad in (-1, 65, "some", True):
            with pytest.raises(ValueError, match='0 to 64 stages, or "auto"'):
                c.train_open("j", "m:f", optimizer={"name": "sgd"}, batch_size=4, pipeline=bad)
    # A sweep's config says it the same way, and is refused the same way before any call.
    config = tmp_path / "sweep.toml"
    config.write_text(
        'factory = "flowmesh.examples:mlp"\ntrials = 1\nsteps = 1\neval_every = 1\n'
        'pipeline = "some"\n[space]\nlr = {low = 0.001, high = 0.1, log = true}\n'
    )
    with pytest.raises(SystemExit) as refused:
        cli.main(["sweep", str(config), "--broker", "tcp://127.0.0.1:9"])
    assert str(refused.value) == (
        f"flowmesh sweep: {config}: pipeline 'some': a number of stages, or auto"
    )


def test_train_says_its_own_process_imports_the_factory_for_synthetic_data() -> None:
    with pytest.raises(SystemExit) as refused:
        cli.main(["train", "no_such_zoo:mlp", "--steps", "1", "--broker", "tcp://127.0.0.1:9"])
    reason = str(refused.value)
    assert reason.startswith("flowmesh train: could not import factory 'no_such_zoo:mlp'")
    assert "importable from this shell too" in reason and "--data FILE" in reason


def test_train_takes_a_factory_or_a_hugging_face_directory_not_both() -> None:
    for argv in (["train", "--steps", "1"], ["train", "m:f", "--hf", "/d", "--steps", "1"]):
        with pytest.raises(SystemExit) as refused:
            cli.main([*argv, "--broker", "tcp://127.0.0.1:9"])
        assert str(refused.value) == "flowmesh train: give a factory module:callable, or --hf DIR"


def test_train_says_its_own_process_reads_the_hugging_face_directory(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as refused:
        cli.main(["train", "--hf", str(tmp_path / "nowhere"), "--steps", "1",
                  "--broker", "tcp://127.0.0.1:9"])  # fmt: skip
    reason = str(refused.value)
    assert reason.startswith("flowmesh train: ") and "readable from this shell too" in reason
    assert "--data FILE" in reason


def test_a_sweep_config_names_a_factory_or_a_hugging_face_directory(tmp_path: Path) -> None:
    rest = 'trials = 1\nsteps = 1\neval_every = 1\n[space]\nlr = {low = 0.001, high = 0.1}\n'
    for head in ("", 'factory = "m:f"\nhf = "tiny"\n'):
        config = tmp_path / "sweep.toml"
        config.write_text(head + rest)
        with pytest.raises(SystemExit) as refused:
            cli.load_sweep_config(str(config))
        assert str(refused.value) == (
            f"flowmesh sweep: {config}: missing keys factory (or hf, a Hugging Face model "
            "directory; not both)"
        )
    config.write_text('hf = "tiny"\n' + rest)
    assert cli.load_sweep_config(str(config))["hf"] == "tiny"
