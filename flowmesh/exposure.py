"""Sockets bound where other hosts reach them, without keys: refused unless asked for.

Without CURVE keys a socket trusts whoever connects: the broker's frontend lets anyone deploy,
undeploy, train and read answers, its backend lets anyone register as a worker and answer runs,
a worker's peer socket takes activations from anyone holding a run's ticket. On loopback (or an
ipc:// path) only this host reaches it. Elsewhere, a process without `--keys` stops at start
unless told `--insecure 1`, and then says in its log, once per socket, what that means.
"""

from __future__ import annotations

import ipaddress
import logging


def reachable_from_other_hosts(endpoint: str) -> bool:
    """False for loopback (127.0.0.0/8, ::1, localhost), ipc:// and inproc://; True for the
    rest, '*', 0.0.0.0, interface and host names included (what they reach is not known here)."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return False
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def check_keyless_bind(
    flag: str, endpoint: str, lets: str, *, keyed: bool, insecure: bool, log: logging.Logger
) -> None:
    """Stop the process (SystemExit with the reason) when `endpoint`, given as `flag`, is bound
    without keys where other hosts reach it and `--insecure` was not given; with it, warn.
    `lets`: what anyone who reaches that socket may then do."""
    if keyed or not reachable_from_other_hosts(endpoint):
        return
    if not insecure:
        raise SystemExit(
            f"{flag} {endpoint}: not a loopback address, and no --keys: anyone who reaches it "
            f"could {lets}. Give --keys DIR (flowmesh keys init), bind 127.0.0.1, or pass "
            "--insecure 1 to run without keys anyway"
        )
    log.warning(
        "INSECURE: %s %s is bound without keys (--insecure 1): anyone who reaches it can %s; "
        "run this only on a network you trust, or give --keys DIR",
        flag,
        endpoint,
        lets,
    )
