from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


# Package scope: set before the module-scoped fixtures that compute reference outputs, and
# restored when this directory is done, so other test packages keep their threads.
@pytest.fixture(scope="package", autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """These tests compare outputs bit for bit (torch.equal), so the CPU must compute the same
    thing twice. With several intra-op threads it sometimes does not: in a fresh process the
    first element-wise op (torch.tanh in GPT-2's gelu_new) split across OpenMP threads can come
    out ~1e-6 different in the half of the tensor the worker thread computed (seen in about 1 run
    in 10 on this 2-core machine, never with one thread). One thread keeps the comparisons about
    the partitioner, not about the thread pool's warm-up."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
