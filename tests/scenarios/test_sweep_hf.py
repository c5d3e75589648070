"""A sweep over a Hugging Face model directory (`sweep(hf=...)`, `hf` in a sweep's TOML): every
trial a training job that starts from the directory's weights, its learning rate sampled, on an
in-process mesh (tests/support/inproc.py); a space that would set the model's keyword arguments
is refused before any trial, as is a sweep naming both a factory and a directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client_sdk import train_data
from flowmesh.spec import ModelSpec
from tests.support.inproc import InProcMesh
from tests.support.lm import tiny_lm_dir
from tests.support.mesh import roots_at
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)

pytest.importorskip("transformers")

LR = {"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}


def test_a_sweep_trains_every_trial_from_the_directorys_weights(tmp_path: Path) -> None:
    model_dir = tiny_lm_dir(tmp_path / "tiny", "llama", seed=3, max_positions=32)
    spec = ModelSpec(name="ft", factory=None, hf=str(model_dir))
    data = train_data.synthetic(spec, loss="cross_entropy", samples=64, seq=8, seed=0, allow=())
    with InProcMesh(
        cpu_workers=2, memory_budget="64MiB", train_bytes=8 << 20, **roots_at(tmp_path)
    ) as mesh, mesh.client(timeout=120) as c:  # fmt: skip
        for bad, why in (
            ({"factory": "flowmesh.examples:mlp", "hf": str(model_dir)}, "or hf= a model"),
            ({"hf": str(model_dir), "space": {**LR, "width": {"type": "int", "low": 8,
                                                              "high": 16}}}, "['width']"),
        ):  # fmt: skip
            kw = {"name": "bad", "space": LR, "data": data, "trials": 1, "steps": 2,
                  "eval_every": 1, "show": False, **bad}  # fmt: skip
            with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
                c.sweep(**kw)
        result = c.sweep(name="ft", hf=str(model_dir), space=LR, data=data, trials=3, steps=4,
                         eval_every=2, concurrency=2, batch=8, show=False,
                         out_dir=tmp_path / "out")  # fmt: skip
    assert len(result.trials) == 3
    assert all(t.state in ("COMPLETE", "PRUNED") and t.evals for t in result.trials), result.trials
    assert all(t.curve and all(map(torch.isfinite, torch.tensor(t.curve))) for t in result.trials)
    # The same weights to start from, different learning rates: the first losses agree, the
    # curves then part.
    firsts = [t.curve[0] for t in result.trials]
    torch.testing.assert_close(firsts, [firsts[0]] * 3, rtol=1e-5, atol=1e-6)
    assert len({round(t.curve[-1], 6) for t in result.trials}) == 3
