"""Decoding cost per message type: `flowmesh.protocol.decode` (every field typed and checked,
tensors listed against their frames) against a bare `msgpack.unpackb` of the same header,
measured in the same run, in this process.

The messages are the ones on the hot paths (a request and its answer, a stage's run and its
result, a training step, a heartbeat, status), each with one small tensor where it carries
tensors. Each figure is the fastest of `--repeats` timings of `--number` decodes, per decode;
the ratio is decode over the bare read of its header.

    python scripts/bench_codec.py [--number 20000] [--repeats 7] [--out bench-out]
"""

from __future__ import annotations

import argparse
import json
import timeit
from pathlib import Path
from typing import Any

import msgpack
import torch

from flowmesh import protocol as p


def _parted(t: torch.Tensor, name: str) -> Any:
    # A run's tensors part by part; as 'k/name' keys before they were declared so (the script
    # also measures the commit before that change).
    return [{name: t}] if getattr(p.Run, "PARTED", False) else {f"0/{name}": t}


def messages() -> dict[str, p.Message]:
    x = torch.zeros(1, 16)
    return {
        "infer": p.Infer(id=1, model="m", tensors={"x": x}, timeout_ms=1000),
        "result": p.Result(id=1, tensors={"": x}),
        "run": p.Run(id=2, model="m", stage=0, parts=[(1, 1)], tensors=_parted(x, "x")),
        "run_result": p.RunResult(id=2, model="m", stage=0, tensors=_parted(x, "")),
        "train_step": p.TrainStep(
            id=3, job="j", seq=1, tensors={"inputs": x, "targets": torch.zeros(1)}
        ),
        "heartbeat": p.Heartbeat(),
        "status": p.Status(id=4),
    }


def measure(number: int, repeats: int) -> dict[str, dict[str, float]]:
    out = {}
    for name, msg in messages().items():
        frames = p.encode(msg)
        frames = [bytes(f) if not isinstance(f, bytes) else f for f in frames]
        assert type(p.decode(frames)) is type(msg)
        header = frames[0]
        decode = min(timeit.repeat(lambda f=frames: p.decode(f), number=number, repeat=repeats))
        bare = min(
            timeit.repeat(lambda h=header: msgpack.unpackb(h), number=number, repeat=repeats)
        )
        out[name] = {
            "decode_us": decode / number * 1e6,
            "bare_us": bare / number * 1e6,
            "ratio": decode / bare,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    figures = measure(args.number, args.repeats)
    print(f"{'message':<12} {'decode µs':>10} {'msgpack µs':>11} {'ratio':>7}")
    for name, f in figures.items():
        print(f"{name:<12} {f['decode_us']:>10.2f} {f['bare_us']:>11.2f} {f['ratio']:>6.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec.json").write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
