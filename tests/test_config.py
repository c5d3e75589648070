"""One TOML file sets every process's defaults, checked against the same declarations as the
flags; flags on the command line win."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from flowmesh.config import BOOL, FLOAT, INT, LOG_LEVEL, SIZE, TEXT, Option, Options

EXAMPLE = Path(__file__).parents[1] / "scripts" / "systemd" / "flowmesh.toml"

TEST = Options(
    "worker",
    prog="test",
    description="",
    options=(
        Option("--heartbeat", FLOAT, 1.0),
        Option("--liveness", INT, 3),
        Option("--memory-budget", SIZE, None),
        Option("--max-message", SIZE, "1GiB"),
        Option("--device", TEXT, "cuda:0"),
        Option("--allow", TEXT, None, repeat=True),
        Option("--log-level", LOG_LEVEL, None),
    ),
)


def services() -> dict[str, Options]:
    from broker.__main__ import OPTIONS as broker
    from gateway.__main__ import OPTIONS as gateway
    from gpu_worker.__main__ import OPTIONS as worker
    from partitioner.__main__ import OPTIONS as partitioner

    return {o.section: o for o in (broker, partitioner, worker, gateway)}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "flowmesh.toml"
    path.write_text(text)
    return str(path)


def rejected(options: Options, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line error a process stops with (exit status 2, as argparse's)."""
    with pytest.raises(SystemExit) as stop:
        options.parse(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    return err


def test_file_sets_defaults_converted_as_flags_and_flags_win(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        '[worker]\nheartbeat = 1\nmemory-budget = "2GiB"\nmax_message = 4096\n'
        'allow = ["a", "b"]\nlog_level = "DEBUG"\n'
        "[broker]\nheartbeat = 9.0\n",
    )
    args = TEST.parse(["--config", cfg])
    assert (args.heartbeat, args.liveness, args.device) == (1.0, 3, "cuda:0")
    assert isinstance(args.heartbeat, float)
    assert (args.memory_budget, args.max_message) == (2 << 30, 4096)
    assert (args.allow, args.log_level) == (["a", "b"], "debug")

    args = TEST.parse(
        ["--config", cfg, "--heartbeat", "3", "--allow", "c", "--memory-budget", "1M"]
    )
    assert (args.heartbeat, args.allow, args.memory_budget) == (3.0, ["c"], 1 << 20)
    # `--config` anywhere on the line; the flags still win.
    assert TEST.parse(["--liveness", "5", "--config", cfg]).liveness == 5

    args = TEST.parse([])
    assert (args.heartbeat, args.memory_budget, args.max_message) == (1.0, None, 1 << 30)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('liveness = "3"', '[worker] liveness: expected an integer, got "3"'),
        ("liveness = 2.5", "[worker] liveness: expected an integer, got 2.5"),
        ("liveness = true", "[worker] liveness: expected an integer, got true"),
        ('heartbeat = "0.5"', '[worker] heartbeat: expected a number, got "0.5"'),
        ("device = 0", "[worker] device: expected a string, got 0"),
        (
            'memory_budget = "60GX"',
            "[worker] memory_budget: expected a size (a byte count, or a "
            'string such as "60GiB"), got "60GX"',
        ),
        ("memory-budget = -1", "[worker] memory-budget: expected a size"),
        ('allow = "a"', '[worker] allow: expected an array of strings, got "a"'),
        ('allow = ["a", 1]', '[worker] allow: in ["a", 1]: expected a string, got 1'),
        ('log_level = "loud"', "[worker] log_level: expected one of"),
        ("heartbeats = 1", "[worker] heartbeats: unknown key (did you mean heartbeat?)"),
        ("config = 'x.toml'", "[worker] config: unknown key"),
        ("heartbeat = 1\nheart-beat = 1", "[worker] heart-beat: unknown key (did you mean"),
        ("max_message = 1\nmax-message = 2", "[worker] max-message: set twice"),
    ],
)
def test_a_wrong_value_names_the_file_the_table_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    cfg = write(tmp_path, f"[worker]\n{line}\n")
    err = rejected(TEST, ["--config", cfg], capsys)
    assert err.startswith(f"test: error: {cfg}: {message}"), err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[wroker]\nliveness = 1\n", "[wroker]: unknown table (the services' tables: broker, "),
        ("worker = 1\n", "worker: expected a table [worker], got 1"),
        ("[worker\n", "Expected ']'"),
    ],
)
def test_a_wrong_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    cfg = write(tmp_path, text)
    err = rejected(TEST, ["--config", cfg], capsys)
    assert err.startswith(f"test: error: {cfg}: ") and message in err, err
    missing = str(tmp_path / "absent.toml")
    assert "No such file" in rejected(TEST, ["--config", missing], capsys)


def test_flags_are_checked_by_the_same_types(capsys: pytest.CaptureFixture[str]) -> None:
    assert "cannot read size '2GX'" in rejected(TEST, ["--memory-budget", "2GX"], capsys)
    assert "invalid int value: '2.5'" in rejected(TEST, ["--liveness", "2.5"], capsys)
    assert "expected one of debug" in rejected(TEST, ["--log-level", "loud"], capsys)


def test_values_a_service_could_never_run_with_stop_it_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A broker with heartbeats every 0 s spun a core while no peer could register (the wire
    # takes only > 0); a worker with 0 compute lanes was refused registration for good.
    by_section = services()
    bounded = {
        (section, o.flag)
        for section, options in by_section.items()
        for o in options.options
        if (o.least, o.above, o.most) != (None, None, None)
    }
    assert {
        ("broker", "--heartbeat"),
        ("broker", "--liveness"),
        ("worker", "--compute-lanes"),
        ("gateway", "--timeout"),
    } <= bounded
    for section, flag in sorted(bounded):
        options = by_section[section]
        (option,) = [o for o in options.options if o.flag == flag]
        cases = [(option.least, -1, "of at least"), (option.above, 0, "over")]
        cases.append((option.most, 1, "of at most"))
        for bound, step, words in cases:
            if bound is None:
                continue
            bad = option.kind.toml(bound + step)  # (an int stays one)
            err = rejected(options, [flag, str(bad)], capsys)
            assert f"argument {flag}: expected {option.kind.what} {words} " in err, err
            cfg = write(tmp_path, f"[{section}]\n{option.dest} = {bad!r}\n")
            err = rejected(options, ["--config", cfg], capsys)
            assert f"[{section}] {option.dest}: expected {option.kind.what} {words} " in err
            edge = bound if step else bound + 1  # the bound itself, or just over it
            assert getattr(options.parse([flag, str(option.kind.toml(edge))]), option.dest) == edge
    assert "over 0, got nan" in rejected(by_section["broker"], ["--heartbeat", "nan"], capsys)


SAMPLES: dict[str, tuple[Any, str]] = {  # per kind: a TOML value, the same value as a flag
    TEXT.what: ("x:1", "x:1"),
    INT.what: (7, "7"),
    FLOAT.what: (0.25, "0.25"),
    SIZE.what: ("3MiB", "3MiB"),
    LOG_LEVEL.what: ("warning", "warning"),
}


def toml_value(value: Any) -> str:
    return '"' + value + '"' if isinstance(value, str) else repr(value)


def test_every_option_of_every_service_reads_the_same_from_the_file_as_from_its_flag(
    tmp_path: Path,
) -> None:
    for section, options in services().items():
        for option in options.options:
            if option.kind is BOOL:  # a switch: no value after the flag
                toml, flag = "true", [option.flag]
            else:
                value, text = SAMPLES[option.kind.what]
                toml = f"[{toml_value(value)}]" if option.repeat else toml_value(value)
                flag = [option.flag, text]
            cfg = write(tmp_path, f"[{section}]\n{option.dest} = {toml}\n")
            from_file = getattr(options.parse(["--config", cfg]), option.dest)
            from_flag = getattr(options.parse(flag), option.dest)
            assert from_file == from_flag != option.default, (section, option.flag)
            assert getattr(options.parse([]), option.dest) != from_flag


def test_the_shipped_example_config_is_accepted_by_every_service() -> None:
    by_section = services()
    example = str(EXAMPLE)
    args = by_section["broker"].parse(["--config", example])
    assert (args.frontend, args.replicas, args.max_message) == ("tcp://0.0.0.0:5555", 2, 1 << 30)
    assert (type(args.heartbeat), type(args.liveness)) == (float, int)
    args = by_section["partitioner"].parse(["--config", example])
    assert args.broker == "tcp://127.0.0.1:5556"
    args = by_section["worker"].parse(["--config", example, "--device", "cpu"])
    assert (args.compute_lanes, args.device) == (2, "cpu")
    args = by_section["gateway"].parse(["--config", example])
    assert (args.host, args.port, args.broker) == ("127.0.0.1", 8000, "tcp://127.0.0.1:5555")
    assert args.api_keys == "/etc/flowmesh/keys/api_keys.json"
    assert set(tomllib.loads(EXAMPLE.read_text())) == set(by_section)


def test_the_example_config_s_commented_out_settings_are_valid_too(tmp_path: Path) -> None:
    """`# key = value` lines in the example are settings to uncomment: they must work."""
    uncommented = re.sub(r"(?m)^# ?([a-z_-]+ = )", r"\1", EXAMPLE.read_text())
    assert uncommented != EXAMPLE.read_text()
    cfg = write(tmp_path, uncommented)
    for options in services().values():
        options.parse(["--config", cfg])
    args = services()["worker"].parse(["--config", cfg])
    assert args.memory_budget == 60 << 30
