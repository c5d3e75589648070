"""A worker lost mid-generation: its sequences start again from their tokens on the replica left
(their KV cache recomputed there), and every call ends with Hugging Face's own greedy tokens.

Two replicas of a one-stage tiny Llama on two workers, sequences on both (max_seqs 2, six
calls); one worker is frozen (SIGSTOP) once tokens flow, so the broker finds it lost by its
missing heartbeats, then killed."""

from __future__ import annotations

import asyncio
import signal

from client_sdk.client import AsyncClient
from client_sdk.mesh import LocalMesh
from flowmesh.modelio.tokenizer import TextCodec, read_tokenizer
from tests.support.lm import hf_generate, tiny_lm_dir
from tests.support.mesh import roots_at

TEXTS = [f"Once upon a time {k}" for k in range(6)]
NEW = 40


def test_sequences_of_a_lost_worker_finish_on_the_other_with_the_same_tokens(tmp_path) -> None:
    model_dir = tiny_lm_dir(tmp_path / "tiny-llama", "llama", seed=7, max_positions=64)
    codec = TextCodec.from_files(read_tokenizer(model_dir))
    expected = hf_generate(model_dir, [codec.encode(t) for t in TEXTS], NEW, ignore_eos=True)
    fast = {"heartbeat_s": 0.2, "liveness": 5, "threads_per_worker": 1}
    with LocalMesh(cpu_workers=2, memory_budget="8MiB", **roots_at(tmp_path), **fast) as mesh:
        with mesh.client() as c:
            c.deploy("lm", hf=str(model_dir), stages=1, replicas=2, max_seqs=2)

        async def main() -> tuple[list[list[int]], int]:
            async with AsyncClient(mesh.frontend, timeout=60) as c:
                flowing = asyncio.Event()

                async def one(text: str) -> list[int]:
                    ids: list[int] = []
                    stream = c.generate_stream("lm", text, max_tokens=NEW, ignore_eos=True)
                    async with stream:
                        async for chunk in stream:
                            ids += chunk.ids
                            if len(ids) >= 3:
                                flowing.set()
                    return ids

                async def freeze() -> None:
                    await flowing.wait()
                    mesh.child("worker-0").proc.send_signal(signal.SIGSTOP)

                *outs, _ = await asyncio.gather(*(one(t) for t in TEXTS), freeze())
                return outs

        def lost() -> int | None:
            with mesh.client() as c:
                st = c.status()
            row = next(m for m in st.models if m.name == "lm")
            return row.restarts if [w.name for w in st.workers] == ["worker-1"] else None

        try:
            outs = asyncio.run(main())
            restarts = mesh.wait_until(lost, "worker-0 found lost", 30)
        finally:
            mesh.child("worker-0").proc.kill()
        # Every call ended with generate's own tokens. Those that ran on the frozen worker
        # started again on the other: `restarts` was 2 in every run on a quiet machine, but it
        # is 0 when the freeze comes after worker-0's sequences have ended, so it is not
        # asserted; the restart itself is tested exactly in tests/broker/test_generation.py.
        assert outs == expected, restarts
