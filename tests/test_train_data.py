"""`flowmesh train --data FILE` (and a sweep's [data] file): a file that does not read is one
bad_request line naming it, not a traceback (client_sdk/train_data.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from client_sdk.train_data import from_file
from flowmesh.errors import Code, FlowmeshError


def test_a_safetensors_file_that_does_not_read_is_a_bad_request(tmp_path: Path) -> None:
    garbled = tmp_path / "garbled.safetensors"
    garbled.write_bytes(b"\xff" * 64)
    for path, said in [
        (tmp_path / "absent.safetensors", "No such file or directory"),
        (garbled, ""),
    ]:
        with pytest.raises(FlowmeshError) as refused:
            from_file(str(path))
        assert refused.value.code == Code.BAD_REQUEST
        assert refused.value.reason.startswith(f"{path}: ") and said in refused.value.reason
    good = tmp_path / "good.safetensors"
    save_file({"inputs": torch.zeros(4, 2), "targets": torch.ones(4)}, str(good))
    assert from_file(str(good)).targets.shape == (4,)
