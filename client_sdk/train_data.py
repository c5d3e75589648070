"""Datasets for `flowmesh train`: a deterministic synthetic one matched to the model, or a file.

- **Synthetic** (`synthetic(...)`): `samples` rows drawn once from a generator seeded with `seed`,
  shaped by the model's declared inputs (`flowmesh_inputs` of the factory's module, or the
  spec's): dim 0 is the row, free dimensions (-1) take `seq`. Floating inputs are standard normal;
  integer inputs (token ids) are uniform in [0, V), V being the size of the model's last output
  dimension when the output has one more dimension than the input (a language model's logits
  over its vocabulary), else 2. Targets follow the loss: for "cross_entropy", class ids in
  [0, C) shaped like the output without its last dimension (C classes); for "mse", standard
  normal values shaped like the output. The output shape comes from one forward on the meta
  device, which reads no values and allocates nothing. The same arguments give the same rows, so
  a run can be repeated, or compared with a plain PyTorch loop.
- **File** (`from_file(path)`): a .safetensors file with an `inputs` tensor (or `inputs/<name>`
  tensors for a model of several inputs) and a `targets` tensor, rows along dim 0; any other file
  is read as a **text corpus** (`text_windows`): next-byte prediction for a language model over
  its bytes (vocabulary 256), rows of `seq` byte ids and the same rows shifted by one byte.
- **Real text, offline** (`stdlib_corpus()`): the source of a few Python standard-library
  modules (`inspect.getsource`), on every machine with Python, no download; `text_windows`
  makes a language model's rows from it, `next_byte_rows` an MLP's (a window of bytes as
  numbers in [-1, 3) -> the byte after it).

`batches(data, batch, steps)` walks the rows in order, `batch` at a time, wrapping around at the
end: step i takes rows i*batch .. (i+1)*batch - 1 modulo the number of rows.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowmesh.errors import bad_request
from flowmesh.modelio.build import build_meta
from flowmesh.modelio.dtypes import torch_dtype
from flowmesh.modelio.inputs import call_model, declared_inputs, example_inputs
from flowmesh.spec import ModelSpec

Inputs = torch.Tensor | dict[str, torch.Tensor]


@dataclass
class Dataset:
    inputs: dict[str, torch.Tensor]  # by input name; "" when the file gave one unnamed tensor
    targets: torch.Tensor
    source: str

    @property
    def rows(self) -> int:
        return int(self.targets.shape[0])


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if hasattr(out, "get") else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise bad_request(
        f"the model returns {type(out).__name__}; training needs a tensor (or logits)"
    )


def synthetic(
    spec: ModelSpec, *, loss: str, samples: int, seq: int, seed: int, allow: tuple[str, ...]
) -> Dataset:
    """The built-in dataset for `spec` (see the module docstring)."""
    model = build_meta(spec, allow)
    declared = declared_inputs(spec, model)
    if not declared:
        raise bad_request(
            f"{spec.factory} declares no inputs (flowmesh_inputs), so no synthetic data can be "
            "made for it: give --data FILE.safetensors with 'inputs' and 'targets'"
        )
    probe = {
        n: t.expand(1, *[seq if d == -1 else d for d in ts.shape[1:]])
        for (n, ts), t in zip(declared.items(), example_inputs(declared, 1).values(), strict=True)
    }
    with torch.no_grad():
        out = _logits(call_model(model.train(), probe))
    g = torch.Generator().manual_seed(seed)
    first = next(iter(declared.values()))
    lm = out.dim() == len(first.shape) + 1
    vocab = int(out.shape[-1]) if lm else 2
    inputs: dict[str, torch.Tensor] = {}
    for name, ts in declared.items():
        shape = [samples] + [seq if d == -1 else d for d in ts.shape[1:]]
        dtype = torch_dtype(ts.dtype)
        if dtype.is_floating_point:
            inputs[name] = torch.randn(shape, generator=g).to(dtype)
        else:
            inputs[name] = torch.randint(0, vocab, shape, generator=g).to(dtype)
    if loss == "cross_entropy":
        classes = int(out.shape[-1])
        targets = torch.randint(0, classes, (samples, *out.shape[1:-1]), generator=g)
    elif loss == "mse":
        targets = torch.randn((samples, *out.shape[1:]), generator=g).to(out.dtype)
    else:
        raise bad_request(f"no synthetic targets for loss {loss!r}: give --data FILE.safetensors")
    return Dataset(inputs, targets, f"synthetic ({samples} rows, seed {seed})")


STDLIB_MODULES = ("textwrap", "heapq", "bisect", "fnmatch", "shlex", "difflib")


def stdlib_corpus(modules: tuple[str, ...] = STDLIB_MODULES) -> torch.Tensor:
    """The bytes (int64) of some standard-library modules' source: real text, offline, the same
    bytes on every run of one Python."""
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)
    return torch.tensor(list(text.encode()), dtype=torch.int64)


def text_windows(text: torch.Tensor, seq: int, source: str) -> Dataset:
    """A language model's rows from a byte corpus: consecutive, non-overlapping windows of
    `seq` + 1 bytes, in order; inputs the first `seq` byte ids, targets the last `seq` (each
    byte's successor)."""
    if seq < 1 or text.numel() < seq + 1:
        raise bad_request(f"{source}: {text.numel()} bytes make no window of {seq} + 1 bytes")
    rows = (text.numel() - 1) // seq
    ids = text[: rows * seq + 1]
    inputs = ids[:-1].reshape(rows, seq).contiguous()
    targets = ids[1:].reshape(rows, seq).contiguous()
    return Dataset({"": inputs}, targets, f"{source}: {rows} windows of {seq} bytes")


def next_byte_rows(
    text: torch.Tensor, context: int, samples: int, seed: int, source: str
) -> Dataset:
    """An MLP's rows from a byte corpus: `samples` windows at positions drawn with `seed`; inputs
    the `context` bytes as numbers in [-1, 3) (byte / 64 - 1), target the byte after them."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, text.numel() - context - 1, (samples,), generator=g)
    windows = torch.stack([text[i : i + context + 1] for i in starts.tolist()])
    return Dataset(
        {"": windows[:, :-1].float() / 64 - 1},
        windows[:, -1].contiguous(),
        f"{source}: {samples} windows of {context} bytes -> the next byte",
    )


def from_file(path: str, seq: int = 32) -> Dataset:
    """A .safetensors file with `inputs` (or `inputs/<name>`) and `targets`, rows on dim 0; any
    other file a text corpus for next-byte prediction in windows of `seq` (`text_windows`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if Path(path).suffix != ".safetensors":
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise bad_request(f"{path}: {exc}") from None
        return text_windows(torch.tensor(list(raw), dtype=torch.int64), seq, path)

    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as exc:  # missing, unreadable, or not safetensors
        raise bad_request(f"{path}: {exc}") from None
    targets = tensors.pop("targets", None)
    if targets is None:
        raise bad_request(
            f"{path}: no 'targets' tensor (found {', '.join(sorted(tensors)) or 'none'})"
        )
    if "inputs" in tensors:
        inputs = {"": tensors.pop("inputs")}
    else:
        inputs = {
            k.removeprefix("inputs/"): v for k, v in tensors.items() if k.startswith("inputs/")
        }
    if not inputs:
        raise bad_request(f"{path}: no 'inputs' (or 'inputs/<name>') tensor")
    rows = {int(t.shape[0]) for t in [*inputs.values(), targets] if t.dim() > 0}
    if len(rows) != 1 or any(t.dim() == 0 for t in [*inputs.values(), targets]):
        raise bad_request(f"{path}: inputs and targets need the same number of rows on dim 0")
    return Dataset(inputs, targets, path)


def batches(data: Dataset, batch: int, steps: int) -> list[tuple[Inputs, torch.Tensor]]:
    """`steps` batches of `batch` rows, in order, wrapping around (see the module docstring)."""
    if batch < 1 or steps < 0:
        raise bad_request("batch must be positive and steps non-negative")
    out: list[tuple[Inputs, torch.Tensor]] = []
    for i in range(steps):
        idx = torch.arange(i * batch, (i + 1) * batch) % data.rows
        named = {k: v[idx] for k, v in data.inputs.items()}
        # One input travels as a plain tensor: the worker gives it to the model's only input.
        inputs: Inputs = next(iter(named.values())) if len(named) == 1 else named
        out.append((inputs, data.targets[idx]))
    return out
