"""What a deployed model is: its spec, declared once, validated, hashable, free of torch.

`ModelSpec` is a `msgspec.Struct`: messages carry it as a field, so msgspec checks its types on
receipt and its `__post_init__` checks the rest, as it does for a spec built in Python (a refusal
there is an `Invalid`, which the codec answers with its reason and the field's path).
The broker imports this without torch; `flowmesh.modelio.build` turns a spec into modules.
"""

from __future__ import annotations

import hashlib
import importlib
import re
from collections.abc import Callable
from typing import Any

import msgpack
import msgspec

from flowmesh.errors import Code, FlowmeshError, Invalid, bad_request

DTYPES = ("float32", "float16", "bfloat16")
TENSOR_DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
DEFAULT_ALLOW = ("flowmesh.examples", "torch.nn")
MAX_STAGES = 64
# How a worker lays tensors out in device memory: each tensor at a multiple of TENSOR_ALIGN,
# each block's range a multiple of BLOCK_ALIGN. Planners leave room for this padding.
TENSOR_ALIGN = 64
BLOCK_ALIGN = 256
MAX_KWARGS_BYTES = 64 * 1024
# Generation's settings and their defaults (`ModelSpec`'s): a spec that leaves them alone keeps
# the form it had before they existed (`to_dict`), and a factory's may not set them.
GENERATION_DEFAULTS: tuple[tuple[str, Any], ...] = (
    ("max_context", None),
    ("max_seqs", 16),
    ("kv_share", 0.5),
)


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One input: dtype and shape; -1 is a free dimension (dim 0 is the batch). On the wire, a
    map {"dtype": ..., "shape": [...]}."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in TENSOR_DTYPES:
            raise Invalid(
                Code.BAD_REQUEST, f"dtype {self.dtype!r} not one of {', '.join(TENSOR_DTYPES)}"
            )
        shape = self.shape
        if (
            not isinstance(shape, list | tuple)
            or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= -1 for d in shape)
        ):
            raise Invalid(Code.BAD_REQUEST, "shape must be a list of sizes, -1 for any")
        if type(shape) is not tuple:
            msgspec.structs.force_setattr(self, "shape", tuple(shape))

    def check(self, name: str, dtype: str, shape: tuple[int, ...] | list[int]) -> None:
        if dtype != self.dtype:
            raise bad_request(f"input {name!r}: dtype {dtype}, model expects {self.dtype}")
        if len(shape) != len(self.shape) or any(
            want not in (-1, got) for want, got in zip(self.shape, shape, strict=True)
        ):
            want = "x".join("N" if d == -1 else str(d) for d in self.shape)
            got_s = "x".join(str(d) for d in shape)
            raise bad_request(f"input {name!r}: shape {got_s}, model expects {want}")


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A deployable model: a factory ("module:callable" + kwargs, weights from a safetensors file
    or a seed) or `hf`, a local Hugging Face model directory (config.json + safetensors files),
    whose architecture must be one flowmesh reads through a registered adapter."""

    name: str
    factory: str | None = None
    kwargs: dict[str, Any] = {}
    weights: str | None = None
    seed: int | None = None
    dtype: str = "float32"
    stages: int | None = None
    max_batch_size: int = 8
    replicas: int | None = None
    inputs: dict[str, TensorSpec] | None = None
    # int or float, as given: the spec's digests hash it as it came (1 and 1.0 pack apart).
    slo_ms: int | float | None = None
    hf: str | None = None
    # Generation (language models from `hf`): the longest sequence (prompt + new tokens; None:
    # the model's own limit), how many sequences run at once, and the share of each stage's
    # worker's serving memory their KV cache may take.
    max_context: int | None = None
    max_seqs: int = 16
    kv_share: float = 0.5

    def __post_init__(self) -> None:
        try:
            self._check()
        except FlowmeshError as exc:  # msgspec reports a ValueError with the field's path
            raise Invalid(exc.code, exc.reason) from None

    def _check(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise bad_request(
                f"model name {self.name!r}: use 1-128 letters, digits, '.', '_' or '-'"
            )
        if self.hf is not None:
            self._check_hf()
        elif not isinstance(self.factory, str) or not FACTORY_RE.match(self.factory):
            raise bad_request(f"factory {self.factory!r}: expected 'package.module:callable'")
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise bad_request("kwargs must be a mapping with string keys")
        try:
            packed = msgpack.packb(self.kwargs)
        except (TypeError, ValueError) as exc:
            raise bad_request(
                f"kwargs must be plain data (numbers, strings, lists, maps): {exc}"
            ) from None
        if len(packed) > MAX_KWARGS_BYTES:
            raise bad_request(f"kwargs are {len(packed)} bytes, limit {MAX_KWARGS_BYTES}")
        if self.weights is not None and self.seed is not None:
            raise bad_request("give either weights or seed, not both")
        if self.weights is not None and (not isinstance(self.weights, str) or not self.weights):
            raise bad_request("weights must be a path to a .safetensors file")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad_request(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise bad_request(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.stages is not None and not (
            isinstance(self.stages, int) and 1 <= self.stages <= MAX_STAGES
        ):
            raise bad_request(
                f"stages must be an integer in 1..{MAX_STAGES} or omitted (automatic)"
            )
        if not isinstance(self.max_batch_size, int) or not 1 <= self.max_batch_size <= 4096:
            raise bad_request("max_batch_size must be an integer in 1..4096")
        if self.replicas is not None and not (
            isinstance(self.replicas, int) and 1 <= self.replicas <= 1024
        ):
            raise bad_request("replicas must be a positive integer or omitted")
        if self.slo_ms is not None and not (
            isinstance(self.slo_ms, int | float) and self.slo_ms > 0
        ):
            raise bad_request("slo_ms must be a positive number of milliseconds")
        if self.inputs is not None:
            msgspec.structs.force_setattr(self, "inputs", parse_inputs(self.inputs))
            for name, t in self.inputs.items():
                # A floating input meets the model's weights in their dtype: another of the
                # deploy dtypes fails every request (a float32 input to a float16 Linear), and
                # the meta run that profiles the model does not check dtypes, so it is refused
                # here (float64, which a model casts itself if it takes it, is left alone).
                if t.dtype in DTYPES and t.dtype != self.dtype:
                    raise bad_request(
                        f"input {name!r} is declared {t.dtype}, but the model is deployed in "
                        f"{self.dtype}: declare its floating inputs {self.dtype} (a model's own "
                        "flowmesh_inputs are taken in the deploy's dtype)"
                    )
        if self.max_context is not None and not (
            isinstance(self.max_context, int) and 1 <= self.max_context <= 1 << 20
        ):
            raise bad_request("max_context must be an integer in 1..1048576 or omitted")
        if not isinstance(self.max_seqs, int) or not 1 <= self.max_seqs <= 4096:
            raise bad_request("max_seqs must be an integer in 1..4096")
        if not isinstance(self.kv_share, int | float) or not 0 < self.kv_share <= 1:
            raise bad_request("kv_share must be a number in (0, 1]")

    def check_generation_settings(self) -> None:
        """Refuse generation's settings on a model that does not generate (a factory's): said at
        deploy, not ignored. Not a check of the spec's form: a spec stored before it, with such
        settings, still reads back (and deploys again) as it was."""
        if self.hf is not None:
            return
        given = [n for n, default in GENERATION_DEFAULTS if getattr(self, n) != default]
        if given:
            raise bad_request(
                f"{', '.join(given)}: generation's settings, for a language model deployed from "
                "a Hugging Face directory (hf=); this model is a factory's"
            )

    def _check_hf(self) -> None:
        # Only the form here: the directory is read where the model is built (partitioner,
        # workers), which is where it has to exist; see flowmesh.modelio.hf_dir.
        if not isinstance(self.hf, str) or not self.hf:
            raise bad_request("hf must be the path of a local Hugging Face model directory")
        if self.factory is not None:
            raise bad_request(
                "give either factory or hf (a Hugging Face model directory), not both"
            )
        if self.kwargs:
            raise bad_request(
                "hf models take no kwargs: the directory's config.json describes them"
            )
        if self.weights is not None:
            raise bad_request("hf models read their weights from the directory; omit weights")
        if self.seed is not None:
            raise bad_request("hf models read their weights from the directory; omit seed")

    @property
    def init_seed(self) -> int:
        """Seed of the random initialisation when no weights file is given."""
        return 0 if self.seed is None else self.seed

    def to_dict(self) -> dict[str, Any]:
        out = msgspec.structs.asdict(self)
        out["kwargs"] = dict(self.kwargs)
        if self.hf is None:
            del out["hf"]  # factory specs keep the form they had before hf existed
        for name, default in GENERATION_DEFAULTS:
            if out[name] == default:
                del out[name]  # and so do specs that leave generation's settings alone
        if self.inputs is not None:
            out["inputs"] = {
                n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in self.inputs.items()
            }
        return out

    @classmethod
    def from_dict(cls, data: Any) -> ModelSpec:
        if not isinstance(data, dict):
            raise bad_request("model spec must be a mapping")
        known = set(cls.__struct_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise bad_request(f"unknown model spec field(s): {', '.join(map(str, unknown))}")
        if "name" not in data or ("factory" not in data and data.get("hf") is None):
            raise bad_request(
                "model spec needs at least 'name' and 'factory' (or 'hf', a directory)"
            )
        return cls(**data)

    def digest(self) -> str:
        """Hash of everything that shapes a plan (not the name, batching or replicas)."""
        key = {
            "factory": self.factory,
            "kwargs": self.kwargs,
            "dtype": self.dtype,
            "inputs": self.to_dict()["inputs"],
        }
        if self.hf is not None:
            key["hf"] = self.hf
        return hashlib.sha256(msgpack.packb(key, use_bin_type=True)).hexdigest()[:16]


def parse_inputs(raw: Any) -> dict[str, TensorSpec]:
    if not isinstance(raw, dict) or not raw:
        raise bad_request("inputs must be a non-empty mapping of name -> {dtype, shape}")
    out: dict[str, TensorSpec] = {}
    for name, item in raw.items():
        if isinstance(item, TensorSpec):  # decoded: checked on receipt
            out[name] = item
            continue
        if not isinstance(name, str) or not isinstance(item, dict):
            raise bad_request("inputs must map names to {'dtype': ..., 'shape': [...]}")
        try:
            out[name] = TensorSpec(item.get("dtype"), item.get("shape"))  # type: ignore[arg-type]
        except FlowmeshError as exc:
            raise bad_request(f"input {name!r}: {exc.reason}") from None
    return out


def factory_allowed(factory: str | None, allow: tuple[str, ...] | list[str]) -> bool:
    """A factory may run only if its module is an allowed module or inside one."""
    if factory is None:
        # A Hugging Face directory (spec.hf): no user code runs, only the registered adapters.
        return True
    module = factory.split(":", 1)[0]
    return any(module == p or module.startswith(p + ".") for p in allow)


def import_callable(factory: str, what: str) -> Callable[..., Any]:
    """The callable `factory` ('package.module:callable') names, imported (its allow-list
    already checked by the caller); `what` names it in errors ("factory", "loss factory")."""
    module_name, attr = factory.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise bad_request(f"could not import {what} {factory!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise bad_request(f"{what} {factory!r} is not a callable")
    return fn


def check_factory(
    factory: str | None, allow: tuple[str, ...] | list[str], who: str = "broker"
) -> None:
    """Refuse a factory outside `allow`, naming the process (`who`) and the list it applied."""
    if not factory_allowed(factory, allow):
        raise FlowmeshError(
            Code.NOT_ALLOWED,
            f"{who} refused factory {factory!r}: not in the allow-list it applies "
            f"({', '.join(allow) or 'empty'}); a factory is code that workers execute, so only "
            "allowed modules run (set the list once with the broker's --allow, or "
            "`flowmesh up --allow`, or LocalMesh(allow=...))",
        )


def narrow_allow(mesh: tuple[str, ...], own: tuple[str, ...] | None) -> tuple[str, ...]:
    """The allow-list a partitioner or worker applies: the broker's (`mesh`), narrowed by its
    own --allow (`own`; None: not given) and never widened by it: a module is allowed iff both
    lists allow it."""
    if own is None:
        return mesh
    out = []
    for m in mesh:
        for o in own:
            if m == o or m.startswith(o + "."):
                out.append(m)
            elif o.startswith(m + "."):
                out.append(o)
    return tuple(dict.fromkeys(out))
