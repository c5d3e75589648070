"""Training a Hugging Face model directory (`train_open(hf=...)`), as a user who fine-tunes a
causal LM they have on disk: the tiny llama and GPT-2 of the generation tests, on an in-process
mesh (tests/support/inproc.py), by memory flow on one worker and pipelined over two. Per-step
losses and the final weights equal a plain PyTorch loop on the model `transformers` loads from
the same directory (`flowmesh.reference.train`, the tolerance rule)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowmesh.reference import train
from tests.support.inproc import InProcMesh
from tests.support.lm import tiny_lm_dir
from tests.support.mesh import roots_at
from tests.support.torch_threads import one_thread  # noqa: F401 (fixture)
from tests.support.training import close

transformers = pytest.importorskip("transformers")

ADAM = {"name": "adam", "lr": 1e-3}
BATCH, SEQ, STEPS, ACCUMULATE = 4, 12, 3, 2


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_hugging_face_directory_trains_as_plain_pytorch_does(arch: str, tmp_path: Path) -> None:
    model_dir = tiny_lm_dir(tmp_path / arch, arch, seed=3, max_positions=32)
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    g = torch.Generator().manual_seed(4)
    batches = [
        (torch.randint(0, vocab, (BATCH, SEQ), generator=g),
         torch.randint(0, vocab, (BATCH, SEQ), generator=g))
        for _ in range(STEPS)
    ]  # fmt: skip
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    expected = train(plain, ADAM, batches, accumulate=ACCUMULATE, rng_seed=0)
    with InProcMesh(
        cpu_workers=2, memory_budget="64MiB", train_bytes=8 << 20, **roots_at(tmp_path)
    ) as mesh, mesh.client(timeout=120) as c:  # fmt: skip
        for pipeline in (0, 2):
            job = c.train_open(f"ft-{pipeline}", hf=str(model_dir), optimizer=ADAM,
                               batch_size=BATCH, accumulate=ACCUMULATE,
                               pipeline=pipeline)  # fmt: skip
            assert len(job.info.pipeline) == pipeline
            losses = [job.step(x, y).loss for x, y in batches]
            close(losses, expected, f"{arch}, pipeline={pipeline}: per-step losses")
            ckpt = tmp_path / f"ck-{pipeline}"
            job.save(str(ckpt))
            job.close()
            got: dict[str, torch.Tensor] = {}
            for f in sorted(ckpt.glob("*.safetensors")):
                got.update(load_file(str(f)))
            for name, want in plain.state_dict().items():
                if name in got:
                    close(got[name], want, f"{arch}, pipeline={pipeline}: tensor {name}")
            # Every tensor saved, under its name in the directory's model (GPT-2's head is its
            # embedding: tied, saved once).
            missing = [n for n in plain.state_dict() if n not in got]
            assert missing == (["lm_head.weight"] if arch == "gpt2" else []), missing
