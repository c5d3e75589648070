"""One TOML file sets every process's defaults; flags on the command line win."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from flowmesh.config import apply_config


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heartbeat", type=float, default=1.0)
    ap.add_argument("--memory-budget", default=None)
    ap.add_argument("--allow", action="append", default=None)
    return ap


def test_file_sets_defaults_and_flags_win(tmp_path: Path) -> None:
    cfg = tmp_path / "flowmesh.toml"
    cfg.write_text(
        '[worker]\nheartbeat = 0.5\nmemory-budget = "2GiB"\nallow = ["a", "b"]\n'
        "[broker]\nheartbeat = 9.0\n"
    )
    args = apply_config(parser(), ["--config", str(cfg)], "worker")
    assert (args.heartbeat, args.memory_budget, args.allow) == (0.5, "2GiB", ["a", "b"])
    args = apply_config(parser(), ["--config", str(cfg), "--heartbeat", "3"], "worker")
    assert args.heartbeat == 3.0
    assert apply_config(parser(), [], "worker").heartbeat == 1.0


def test_unknown_keys_and_bad_files_are_clear_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "flowmesh.toml"
    cfg.write_text("[worker]\nheartbeats = 1\n")
    with pytest.raises(SystemExit):
        apply_config(parser(), ["--config", str(cfg)], "worker")
    cfg.write_text("[worker\n")
    with pytest.raises(SystemExit, match="config"):
        apply_config(parser(), ["--config", str(cfg)], "worker")


def test_the_shipped_example_config_is_accepted_by_every_service() -> None:
    from broker.__main__ import parser as broker_parser
    from gpu_worker.__main__ import parser as worker_parser
    from partitioner.__main__ import parser as partitioner_parser

    example = str(Path(__file__).parents[1] / "scripts" / "systemd" / "flowmesh.toml")
    args = apply_config(broker_parser(), ["--config", example], "broker")
    assert (args.frontend, args.replicas) == ("tcp://0.0.0.0:5555", 2)
    args = apply_config(partitioner_parser(), ["--config", example], "partitioner")
    assert args.broker == "tcp://127.0.0.1:5556"
    args = apply_config(worker_parser(), ["--config", example, "--device", "cpu"], "worker")
    assert (args.compute_lanes, args.device) == (2, "cpu")
