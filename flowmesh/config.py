"""One TOML file configures every process: a table per service, keys named like its flags.

    [broker]
    frontend = "tcp://0.0.0.0:5555"
    heartbeat = 1.0

    [worker]
    broker = "tcp://10.0.0.1:5556"
    memory_budget = "60GiB"

Flags given on the command line win over the file.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any


def apply_config(
    parser: argparse.ArgumentParser, argv: list[str] | None, section: str
) -> argparse.Namespace:
    """Parse `argv`, with defaults taken from `--config FILE`'s `[section]` table."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    parser.add_argument("--config", help=f"TOML file; its [{section}] table sets defaults")
    if known.config:
        table = load_section(known.config, section)
        dests = {a.dest for a in parser._actions}
        unknown = sorted(set(table) - dests)
        if unknown:
            parser.error(f"{known.config}: unknown key(s) in [{section}]: {', '.join(unknown)}")
        parser.set_defaults(**table)
    return parser.parse_args(argv)


def load_section(path: str, section: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"config {path}: {exc}") from None
    table = data.get(section, {})
    if not isinstance(table, dict):
        raise SystemExit(f"config {path}: [{section}] must be a table")
    return {k.replace("-", "_"): v for k, v in table.items()}
