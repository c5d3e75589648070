"""Which CPUs a process runs on (`--cpus`), set once at start for every thread it has.

On a GPU server a worker belongs on the cores next to its GPU (its NUMA node), and the broker
on cores no worker uses. It also decides what a hand-off between a process's threads costs:
the worker's event loop hands each run to a compute lane and gets the result back, and ZeroMQ's
I/O thread hands it every message. Between threads on different CPUs each hand-off wakes a
sleeping CPU; on a virtual machine that is an interrupt through the hypervisor, measured at
about 100 us on a 2-core VM against about 20 us between threads sharing one CPU
(scripts/bench_broker.py --pin shows what it does to a request's latency).
"""

from __future__ import annotations

import contextlib
import os


def parse_cpus(text: str) -> set[int]:
    """CPUs written as taskset and systemd's CPUAffinity= write them: '0-3,6'."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"--cpus {text!r}: expected CPU numbers and ranges such as 0-3,6")
        lo, hi = int(first), int(last) if sep else int(first)
        if hi < lo:
            raise ValueError(f"--cpus {text!r}: range {part} runs backwards")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError(f"--cpus {text!r}: no CPU named")
    return cpus


def pin_process(text: str) -> set[int]:
    """Run every thread of this process, and every thread it starts later, on the CPUs `text`
    names (all of them must be CPUs this process may use). Returns the set."""
    cpus = parse_cpus(text)
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        missing = ",".join(str(c) for c in sorted(cpus - allowed))
        usable = ",".join(str(c) for c in sorted(allowed))
        raise ValueError(
            f"--cpus {text!r}: CPU {missing} is not one this process may use: {usable}"
        )
    # sched_setaffinity(0) covers the calling thread only (new threads inherit it): the
    # threads already started (ZeroMQ's, torch's) are set one by one.
    tasks = "/proc/self/task"
    for tid in (int(t) for t in os.listdir(tasks)) if os.path.isdir(tasks) else ():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)
    os.sched_setaffinity(0, cpus)
    return cpus
