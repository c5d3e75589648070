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
