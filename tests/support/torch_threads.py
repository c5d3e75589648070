"""One torch intra-op thread for the duration of each test of a module that imports `one_thread`.

Plain loops that must reduce in the same order as a worker running `--threads 1` need it, and on
two cores it keeps a test's own compute from competing with the executor's lanes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
