"""Each process's options, declared once: they build its flags and read its table of the TOML file.

One TOML file configures every process on a host, a table per service whose keys are its flags
(`memory_budget` or `memory-budget` for `--memory-budget`):

    [broker]
    frontend = "tcp://0.0.0.0:5555"
    heartbeat = 1.0

    [worker]
    broker = "tcp://10.0.0.1:5556"
    memory_budget = "60GiB"

A value in the file is checked against the same declaration as its flag, strictly: numbers are
TOML numbers (`liveness = "3"` is an error, not a string the process trips over later), text is
a TOML string, sizes are a byte count or a string such as "60GiB", repeatable flags take an array.
A wrong type, an unknown key or an unknown table stops the process with a message naming the
file, the table and the key. Flags given on the command line win over the file.
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowmesh.units import parse_size

# The tables a config file may hold: one per service that reads it.
SECTIONS = ("broker", "partitioner", "worker", "gateway")


class ConfigError(ValueError):
    """A value of the config file that its option does not accept."""


def _show(value: Any) -> str:
    """A TOML value as it was written, for error messages: "3", 3, true, [1, 2]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "a table"
    return str(value)


@dataclass(frozen=True)
class Kind:
    """A type of option: how a flag's text and how a TOML value become the option's value."""

    what: str  # for messages: "an integer"
    many: str  # and of an array of them: "integers"
    flag: Callable[[str], Any]  # argparse's type=; raises ValueError/ArgumentTypeError
    toml: Callable[[Any], Any]  # raises ConfigError


def _text_toml(value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"expected a string, got {_show(value)}")
    return value


def _int_toml(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"expected an integer, got {_show(value)}")
    return value


def _float_toml(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"expected a number, got {_show(value)}")
    return float(value)


def _size_flag(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_toml(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError:
            pass
    raise ConfigError(
        f'expected a size (a byte count, or a string such as "60GiB"), got {_show(value)}'
    )


LEVELS = ("debug", "info", "warning", "error", "critical")


def _level_flag(text: str) -> str:
    if text.lower() not in LEVELS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(LEVELS)}, got {text!r}")
    return text.lower()


def _level_toml(value: Any) -> str:
    if not isinstance(value, str) or value.lower() not in LEVELS:
        raise ConfigError(
            f"expected one of {', '.join(map(json.dumps, LEVELS))}, got {_show(value)}"
        )
    return value.lower()


TEXT = Kind("a string", "strings", str, _text_toml)
INT = Kind("an integer", "integers", int, _int_toml)
FLOAT = Kind("a number", "numbers", float, _float_toml)
SIZE = Kind("a size", "sizes", _size_flag, _size_toml)  # '2GiB', '512MB', a byte count -> int bytes
LOG_LEVEL = Kind("a log level", "log levels", _level_flag, _level_toml)


def _bool_toml(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"expected true or false, got {_show(value)}")
    return value


# A switch: a flag without a value (`--insecure-open`) on the command line, true/false in the file.
BOOL = Kind("true or false", "booleans", bool, _bool_toml)


@dataclass(frozen=True)
class Option:
    """One option of a process: its flag and its key in the process's table of the config file.

    `default` is given as the flag would be (a SIZE's "1GiB" becomes bytes); `repeat` makes a
    repeatable flag (`--allow a --allow b`) whose key takes an array (`allow = ["a", "b"]`).
    """

    flag: str  # "--memory-budget"
    kind: Kind = TEXT
    default: Any = None
    help: str | None = None
    repeat: bool = False
    # Bounds of a number's value, checked as it is read (a value the process's peers or the
    # wire would refuse later stops it at start, in one line, rather than loop or spin).
    least: float | None = None
    above: float | None = None
    most: float | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def out_of_bounds(self, value: Any) -> str | None:
        """Why `value` is outside the option's bounds; None: within them."""
        # (Each test negated: NaN passes none of them.)
        if self.least is not None and not value >= self.least:
            return f"expected {self.kind.what} of at least {self.least:g}, got {value!r}"
        if self.above is not None and not value > self.above:
            return f"expected {self.kind.what} over {self.above:g}, got {value!r}"
        if self.most is not None and not value <= self.most:
            return f"expected {self.kind.what} of at most {self.most:g}, got {value!r}"
        return None

    def _flag_value(self, text: str) -> Any:
        value = self.kind.flag(text)
        why = self.out_of_bounds(value)
        if why is not None:
            raise argparse.ArgumentTypeError(why)
        return value

    def add_to(self, ap: argparse.ArgumentParser, *, defaults: bool = True) -> None:
        bounded = (self.least, self.above, self.most) != (None, None, None)
        kw: dict[str, Any] = {
            "type": self._flag_value if bounded else self.kind.flag,
            "help": self.help,
        }
        if self.kind is BOOL:
            kw = {"action": "store_true", "help": self.help}
        elif self.repeat:
            kw["action"] = "append"
        kw["default"] = self.default if defaults else argparse.SUPPRESS
        ap.add_argument(self.flag, **kw)

    def from_toml(self, value: Any) -> Any:
        if not self.repeat:
            return self._toml_value(value)
        if not isinstance(value, list):
            raise ConfigError(f"expected an array of {self.kind.many}, got {_show(value)}")
        try:
            return [self._toml_value(v) for v in value]
        except ConfigError as exc:
            raise ConfigError(f"in {_show(value)}: {exc}") from None

    def _toml_value(self, value: Any) -> Any:
        got = self.kind.toml(value)
        why = self.out_of_bounds(got)
        if why is not None:
            raise ConfigError(why)
        return got


@dataclass(frozen=True)
class Options:
    """A process's options: its command line and its `[section]` of the config file."""

    section: str
    prog: str
    description: str
    options: Sequence[Option]

    def parser(self, *, defaults: bool = True) -> argparse.ArgumentParser:
        ap = argparse.ArgumentParser(
            prog=self.prog,
            description=self.description,
            argument_default=None if defaults else argparse.SUPPRESS,
        )
        for option in self.options:
            option.add_to(ap, defaults=defaults)
        ap.add_argument(
            "--config",
            metavar="FILE",
            help=f"TOML file; its [{self.section}] table sets defaults (flags win)",
        )
        return ap

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """The process's options: flags given in `argv`, else the `--config` file's values, else
        the declared defaults."""
        ap = self.parser()
        args = ap.parse_args(argv)  # --help, and errors in flags, before the file is read
        if not args.config:
            return args
        try:
            values = self.read(args.config)
        except ConfigError as exc:
            ap.exit(2, f"{ap.prog}: error: {exc}\n")
        given = vars(self.parser(defaults=False).parse_args(argv))
        for dest, value in values.items():
            if dest not in given:
                setattr(args, dest, value)
        return args

    def read(self, path: str) -> dict[str, Any]:
        """The file's `[section]` table, checked and converted: {dest: value}."""
        table = load_section(path, self.section)
        by_key = {o.dest: o for o in self.options}
        values: dict[str, Any] = {}
        for key, value in table.items():
            where = f"{path}: [{self.section}] {key}"
            option = by_key.get(key.replace("-", "_"))
            if option is None:
                known = sorted(by_key)
                close = difflib.get_close_matches(key.replace("-", "_"), known, n=1)
                hint = f"did you mean {close[0]}?" if close else "known keys: " + ", ".join(known)
                raise ConfigError(f"{where}: unknown key ({hint})")
            if option.dest in values:
                raise ConfigError(f"{where}: set twice (as {option.dest} and a dashed spelling)")
            try:
                values[option.dest] = option.from_toml(value)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        return values


def load_section(path: str, section: str) -> dict[str, Any]:
    """The `[section]` table of the TOML file at `path` ({} when it has none). Every top-level
    entry must be one of the services' tables, so a misspelt table is an error, not ignored."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    for name, value in data.items():
        if name not in SECTIONS:
            raise ConfigError(
                f"{path}: [{name}]: unknown table (the services' tables: {', '.join(SECTIONS)})"
            )
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: {name}: expected a table [{name}], got {_show(value)}")
    return data.get(section, {})


# Options several services declare alike: one declaration each.
METRICS_PORT = Option(
    "--metrics-port", INT, 0, "serve Prometheus /metrics on this TCP port (0: off)"
)
LOG_LEVEL_OPTION = Option("--log-level", LOG_LEVEL, None, "debug, info, warning, error or critical")
CPUS = Option(
    "--cpus",
    TEXT,
    None,
    "run this process on these CPUs only, as taskset writes them (0-3,6); a worker on the "
    "cores next to its GPU, the broker on cores no worker uses (default: any)",
)
# Without --keys, a non-loopback bind is refused unless this is given (flowmesh.exposure).
INSECURE = Option(
    "--insecure",
    INT,
    0,
    "1: without --keys, bind a non-loopback address anyway; anyone who reaches it is trusted "
    "(the log says so). 0: such a bind stops the process",
)
# A partitioner's or worker's own allow-list (it narrows the broker's) and its CURVE key.
PEER_ALLOW = Option("--allow", TEXT, None, "allowed factory modules (repeatable)", repeat=True)
# Where a partitioner or worker reads the files clients name (flowmesh/roots.py).
DATA_ROOT = Option(
    "--data-root",
    TEXT,
    None,
    "a directory under which clients may name files to read: weights, Hugging Face "
    "directories, checkpoints to resume (repeatable; default: the working directory)",
    repeat=True,
)
PEER_KEYS = Option(
    "--keys",
    TEXT,
    None,
    "key directory holding NAME.key_secret and broker.key (or the .key_secret file): "
    "CURVE to the broker",
)
