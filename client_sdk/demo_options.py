"""The demo's options, on `flowmesh demo` and on `python -m client_sdk.demo` alike.

Apart from `client_sdk.demo` so that the CLI builds its parser without importing the demo (and
torch with it): every other command then starts in a fraction of torch's import time.
"""

from __future__ import annotations

import argparse


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-budget", default="48MiB")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
