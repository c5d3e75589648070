"""Hugging Face models from a local directory (`ModelSpec.hf`): no download, no user code.

A directory holds `config.json` and the weights as `model.safetensors`, or sharded as
`model-0000X-of-0000N.safetensors` with `model.safetensors.index.json` naming the file of each
tensor. The model is built from the config on the meta device (no memory) and read through the
architecture adapters registered in `flowmesh.modelio.chain`; only those architectures are accepted,
so a directory deploy runs library code flowmesh knows how to cut, never code from the directory
(`trust_remote_code` stays off). Each stage then reads only its own tensors from the files.

Non-persistent buffers (rotary `inv_freq`) are not in the files; the adapters rebuild them from
the config (`flowmesh.modelio.hf_adapters`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from flowmesh.errors import FlowmeshError, bad_request
from flowmesh.modelio import weights
from flowmesh.modelio.chain import adapter_classes
from flowmesh.roots import io_error, not_safetensors

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Set to a directory to have every process append the tensors it reads from hf directories to
# `<dir>/<pid>.reads` ("file<TAB>key" lines): how end-to-end tests check that each worker reads
# only its stage's tensors. Off unless set.
READ_LOG_ENV = "FLOWMESH_HF_READ_LOG"

# In-process observers of tensor reads, (file, key) each (see `observe_reads`).
_observers: list[Callable[[str, str], None]] = []
_observers_lock = threading.Lock()


def supported_architectures() -> list[str]:
    """Class names of the transformers models flowmesh has an adapter for."""
    return sorted(
        key.rsplit(".", 1)[1] for key in adapter_classes() if key.startswith("transformers.")
    )


def read_config(path: str) -> dict[str, Any]:
    """The directory's config.json as a mapping, with clear errors for what is missing."""
    root = Path(path)
    if not root.is_dir():
        raise bad_request(f"hf directory {path!r} does not exist or is not a directory")
    cfg = root / CONFIG
    if not cfg.is_file():
        raise bad_request(f"hf directory {path!r} has no {CONFIG}")
    try:
        data = json.loads(cfg.read_bytes())
    except OSError as exc:
        raise io_error(exc, f"hf directory {path!r}: {CONFIG}") from None
    except ValueError:  # the parser's text may quote the file (a byte that is not UTF-8)
        raise bad_request(f"hf directory {path!r}: {CONFIG} is unreadable: not JSON") from None
    if not isinstance(data, dict):
        raise bad_request(f"hf directory {path!r}: {CONFIG} is not a JSON object")
    return data


def architecture(path: str, config: dict[str, Any] | None = None) -> str:
    """The directory's architecture (config.json `architectures[0]`), checked to be supported.
    A refusal does not quote the file: only names flowmesh itself supports are ever shown."""
    config = read_config(path) if config is None else config
    archs = config.get("architectures")
    supported = supported_architectures()
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise bad_request(
            f"hf directory {path!r}: {CONFIG} names no architecture; supported: "
            f"{', '.join(supported)}"
        )
    if len(archs) != 1 or archs[0] not in supported:
        raise bad_request(
            f"hf directory {path!r}: the architecture {CONFIG} names is not supported; "
            f"supported: {', '.join(supported)}"
        )
    return archs[0]


def build_meta(path: str) -> nn.Module:
    """The directory's model on the meta device, with `flowmesh_inputs` (token ids)."""
    config_data = read_config(path)
    arch = architecture(path, config_data)
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except FlowmeshError:
        raise
    except Exception as exc:
        raise bad_request(
            f"hf directory {path!r}: cannot build {arch}: {type(exc).__name__}: {exc}"
        ) from None
    if type(model).__name__ != arch:
        raise bad_request(
            f"hf directory {path!r}: {CONFIG} says {arch}, but its model_type builds "
            f"{type(model).__name__}"
        )
    model.flowmesh_inputs = {"input_ids": {"dtype": "int64", "shape": [-1, -1]}}
    return model


def weight_files(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file (full path) holding it."""
    root = Path(path)
    index = root / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
        except OSError as exc:
            raise io_error(exc, f"hf directory {path!r}: {INDEX}") from None
        except (ValueError, KeyError, TypeError):
            raise bad_request(
                f"hf directory {path!r}: {INDEX} is unreadable: no JSON weight_map"
            ) from None
        if not isinstance(weight_map, dict):
            raise bad_request(f"hf directory {path!r}: {INDEX} has no weight_map mapping")
        out = {}
        for key, name in weight_map.items():
            if not isinstance(name, str) or os.path.basename(name) != name:
                # Not quoted: only a name that is a file of the directory is ever shown.
                raise bad_request(
                    f"hf directory {path!r}: {INDEX} maps a tensor outside the directory"
                )
            out[key] = str(root / name)
        return out
    single = root / SINGLE
    if not single.is_file():
        raise bad_request(f"hf directory {path!r} has neither {SINGLE} nor {INDEX}")
    try:
        with safe_open(str(single), framework="pt", device="cpu") as f:
            return dict.fromkeys(f.keys(), str(single))
    except OSError as exc:
        raise io_error(exc, f"hf directory {path!r}: {SINGLE}") from None
    except Exception:  # safetensors' own error types, whose text may quote the file
        raise not_safetensors(f"hf directory {path!r}: {SINGLE}") from None


@contextmanager
def observe_reads() -> Iterator[list[tuple[str, str]]]:
    """Within the block, every tensor this process reads from an hf directory is appended to the
    yielded list as (file name, key)."""
    seen: list[tuple[str, str]] = []

    def record(file: str, key: str) -> None:
        seen.append((os.path.basename(file), key))

    with _observers_lock:
        _observers.append(record)
    try:
        yield seen
    finally:
        with _observers_lock:
            _observers.remove(record)


def _report(file: str, keys: list[str]) -> None:
    with _observers_lock:
        observers = list(_observers)
    for fn in observers:
        for key in keys:
            fn(file, key)
    log_dir = os.environ.get(READ_LOG_ENV)
    if log_dir:
        with open(os.path.join(log_dir, f"{os.getpid()}.reads"), "a") as fh:
            fh.writelines(f"{os.path.basename(file)}\t{key}\n" for key in keys)


def locate(
    path: str, names: dict[str, str], base_prefix: str = ""
) -> dict[str, list[tuple[str, str]]]:
    """Where the tensors named in `names` (local name -> model state_dict name) are stored:
    file -> [(local name, name in the file)]. A name missing from the files is also looked for
    without the model's `base_prefix` ("transformer." for GPT-2), as older checkpoints store
    the base model's names."""
    files = weight_files(path)
    by_file: dict[str, list[tuple[str, str]]] = {}
    for local, name in names.items():
        stored = name
        if stored not in files and base_prefix and name.startswith(base_prefix + "."):
            stored = name[len(base_prefix) + 1 :]
        if stored not in files:
            raise bad_request(f"hf directory {path!r}: tensor {name!r} is missing from its weights")
        by_file.setdefault(files[stored], []).append((local, stored))
    return by_file


def read_weights_into(
    path: str,
    dests: dict[str, torch.Tensor],
    base_prefix: str = "",
    progress: Callable[[int], None] | None = None,
) -> None:
    """Read each tensor named in `dests` (model state_dict name -> a contiguous CPU tensor of its
    shape and dtype, e.g. a view of a stage's host buffer) from the directory's safetensors
    file(s) straight into its destination (`weights.read_weights_into`: one copy)."""
    for file, wanted in locate(path, {n: n for n in dests}, base_prefix).items():
        into = {stored: dests[local] for local, stored in wanted}
        weights.read_weights_into(file, into, progress)
        _report(file, [stored for _, stored in wanted])


def read_weights(
    path: str,
    names: dict[str, str],
    expected: dict[str, torch.Tensor],
    base_prefix: str = "",
) -> dict[str, torch.Tensor]:
    """Read only the tensors named in `names` (local name -> model state_dict name) from the
    directory's safetensors file(s), each conformed to `expected` (meta tensors of the model's
    shapes and dtypes); only the files holding one of them are opened (see `locate`)."""
    out: dict[str, torch.Tensor] = {}
    for file, wanted in locate(path, names, base_prefix).items():
        where = f"hf directory {path!r}: {os.path.basename(file)}"
        try:
            handle = safe_open(file, framework="pt", device="cpu")
        except OSError as exc:
            raise io_error(exc, where) from None
        except Exception:  # safetensors' own error types, whose text may quote the file
            raise not_safetensors(where) from None
        with handle as f:
            present = set(f.keys())
            for local, stored in wanted:
                if stored not in present:
                    raise bad_request(
                        f"hf directory {path!r}: tensor {stored!r} is not in "
                        f"{os.path.basename(file)}, where {INDEX} puts it"
                    )
                out[local] = weights.conform(
                    f.get_tensor(stored),
                    expected[local],
                    f"hf directory {path!r}: tensor {stored!r}",
                )
        _report(file, [stored for _, stored in wanted])
    return out


def rebuild_rotary(config: Any, rotary: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """A fresh copy of a rotary-embedding module on `device`, its non-persistent buffers
    (`inv_freq`) computed from the config in float32, as transformers computes them."""
    with torch.device(device):
        return type(rotary)(config=config)


@torch.no_grad()
def load_whole(model: nn.Module, path: str) -> nn.Module:
    """`model` (built on meta by `build_meta`) with every tensor read from the directory onto
    the CPU: tied tensors stay one tensor, non-persistent buffers are rebuilt from the config."""
    state = model.state_dict(keep_vars=True)
    first: dict[int, str] = {}
    for name, tensor in state.items():
        first.setdefault(id(tensor), name)
    wanted = {name: state[name] for name in first.values()}
    values = read_weights(
        path, {n: n for n in wanted}, wanted, getattr(model, "base_model_prefix", "")
    )
    for _, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            slots: dict[str, torch.Tensor | None] = getattr(module, kind)
            for name, old in slots.items():
                if old is None or id(old) not in first:
                    continue
                value = values[first[id(old)]]
                if isinstance(old, nn.Parameter) and not isinstance(value, nn.Parameter):
                    value = nn.Parameter(value, requires_grad=old.requires_grad)
                    values[first[id(old)]] = value  # the next user of the tie gets this object
                slots[name] = value
    for _, module in model.named_modules():
        stale = [
            b
            for b in module._non_persistent_buffers_set
            if module._buffers.get(b) is not None and module._buffers[b].is_meta
        ]
        if not stale:
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            raise bad_request(
                f"hf directory {path!r}: {type(module).__name__} has buffers that are not in the "
                f"weights ({', '.join(stale)}) and flowmesh does not know how to rebuild them"
            )
        fresh = rebuild_rotary(model.config, module)
        for b in stale:
            module._buffers[b] = fresh._buffers[b]
    return model.eval()
