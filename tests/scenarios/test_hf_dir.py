"""A Hugging Face model directory deployed through an in-process mesh (tests/support/inproc.py):
planned on meta by the partitioner, each of two stages read by its worker from the sharded
safetensors files (only its own tensors), served, and compared with the HF model's own forward."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from flowmesh.modelio import hf_dir
from flowmesh.modelio.build import build_meta
from flowmesh.modelio.chain import chain_of
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from tests.support.inproc import InProcMesh
from tests.support.mesh import roots_at


def test_a_llama_directory_is_served_in_two_stages(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    hf = LlamaForCausalLM(cfg).eval()
    model_dir = tmp_path / "tiny-llama"
    hf.save_pretrained(model_dir, max_shard_size="60KB")
    assert (model_dir / "model.safetensors.index.json").is_file()

    # Every tensor read from an hf directory in this process, by the thread that read it: a
    # worker reads its stages on its one deploy thread (`gpu_worker.hands`), so the reads group
    # by worker as the real mesh's per-process read logs (`hf_dir.READ_LOG_ENV`) group them.
    # `observe_reads` does not say which thread read; its observers list does.
    by_thread: dict[int, list[str]] = {}

    def record(file: str, key: str) -> None:
        by_thread.setdefault(threading.get_ident(), []).append(key)

    with hf_dir._observers_lock:
        hf_dir._observers.append(record)
    try:
        with (
            InProcMesh(cpu_workers=2, memory_budget="8MiB", **roots_at(tmp_path)) as mesh,
            mesh.client() as c,
        ):
            status = c.deploy("tiny-llama", hf=str(model_dir), stages=2, replicas=1)
            assert status.factory is None and len(status.stages) == 2
            for length in (5, 11):
                ids = torch.randint(0, 256, (2, length))
                with torch.no_grad():
                    expected = hf(input_ids=ids, use_cache=False).logits
                assert_forward_close(c.infer("tiny-llama", ids), expected)
    finally:
        with hf_dir._observers_lock:
            hf_dir._observers.remove(record)

    # Each worker read exactly its stage's tensors (the partitioner and broker read none).
    blocks = chain_of(build_meta(ModelSpec(name="x", hf=str(model_dir))))
    wanted = sorted(
        sorted({o for blk in blocks[a:b] for o in blk.tensor_names.values()})
        for a, b in (s.blocks for s in status.stages)
    )
    got = sorted(sorted(keys) for keys in by_thread.values())  # a key read twice shows twice
    assert got == wanted
