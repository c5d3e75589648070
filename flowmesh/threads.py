"""Thread pools for torch work that honour the process's torch thread count.

`torch.set_num_threads(n)` sets OpenMP's thread count for the calling thread only. A thread
started later gets OpenMP's default (every core) until torch happens to initialise it, and some
kernels (GELU, for one) open a parallel region before that: on a worker started with
`--threads 1`, each such op then ran on every core, and OpenMP's idle threads spin after each
region, so a 16-float GELU cost twice its CPU time. Every pool that runs torch work is built
here and sets the creating thread's count in each of its threads at start.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def torch_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads run torch with the thread count of the thread creating it."""
    return ThreadPoolExecutor(
        workers,
        thread_name_prefix=name,
        initializer=torch.set_num_threads,
        initargs=(torch.get_num_threads(),),
    )
