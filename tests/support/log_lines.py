"""Every log record the process writes during a test, to count lines under a flood."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def captured_lines() -> Iterator[Lines]:
    """The root logger's records at INFO and above while the block runs."""
    handler, root = Lines(), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
