"""Structured, one-line logs: `time level service event key=value ...`, greppable and parseable."""

from __future__ import annotations

import logging
import os
import sys


def setup(service: str, level: str | None = None) -> logging.Logger:
    level = level or os.environ.get("FLOWMESH_LOG", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return logging.getLogger(service)


def kv(**fields: object) -> str:
    """`key=value` pairs for a log line; values with spaces are quoted."""
    parts = []
    for k, v in fields.items():
        s = str(v)
        parts.append(f"{k}={s!r}" if " " in s else f"{k}={s}")
    return " ".join(parts)
