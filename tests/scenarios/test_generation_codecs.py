"""The tokenizers a long-lived client keeps (the gateway's is one), through an in-process mesh
(tests/support/inproc.py): a model's is forgotten when that client undeploys it, and only the
models used last keep theirs."""

from __future__ import annotations

from pathlib import Path

from tests.support.inproc import InProcMesh
from tests.support.lm import tiny_lm_dir


async def test_a_client_forgets_an_undeployed_model_s_tokenizer_and_keeps_the_last_few(
    tmp_path: Path,
) -> None:
    model_dir = tiny_lm_dir(tmp_path / "tiny", "llama", layers=1, hidden=16)
    with InProcMesh(memory_budget="16MiB", data_roots=[tmp_path]) as mesh:
        async with mesh.async_client(timeout=120) as client:
            codecs = client.codecs
            codecs.KEPT = 2  # (64 by default)
            for name in ("a", "b", "c"):
                await client.deploy(name, hf=str(model_dir), stages=1, replicas=1)
                out = await client.generate(name, "The fox", max_tokens=2, ignore_eos=True)
                assert out.text is not None and len(out.ids) == 2
            assert list(codecs._codecs) == ["b", "c"]  # "a", used first, went
            await client.generate("b", "The fox", max_tokens=1)  # "b" used last now
            await client.undeploy("b")
            assert list(codecs._codecs) == ["c"]
            # Under that name again (the same files here): fetched afresh, not the old one.
            await client.deploy("b", hf=str(model_dir), stages=1, replicas=1)
            await client.generate("b", "The fox", max_tokens=1)
            assert list(codecs._codecs) == ["c", "b"]
