"""Profiling a model's chain: bytes per block, activations per sample, optionally times.

Bytes and activations come from the meta device (no memory, no compute): shapes propagate
through the chain from the declared inputs, and the tensors autograd saves for backward are
caught with `saved_tensors_hooks` while each block runs in training mode. Times, when asked for,
are measured on a real device with random weights, one block at a time, so profiling needs no
more memory than the largest block.

`make_chunk_plan` profiles a spec and plans its training chunks (`flowmesh.modelio.plan`).
"""

from __future__ import annotations

import copy
import inspect
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_meta
from flowmesh.modelio.chain import Block, chain_of, first_names
from flowmesh.modelio.costs import BlockProfile, ModelProfile
from flowmesh.modelio.inputs import call_model, declared_inputs, make_inputs
from flowmesh.modelio.plan import Plan, chunk_plan
from flowmesh.optimizers import state_count
from flowmesh.spec import DEFAULT_ALLOW, ModelSpec

Inputs = dict[str, torch.Tensor]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    try:
        return ("storage", t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without a plain storage
        return ("tensor", id(t))


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return _nbytes(t)


class _SavedTensors:
    """Bytes of distinct storages autograd saves, weights excluded (they are counted as such)."""

    def __init__(self, exclude: set[tuple[str, int]]) -> None:
        self.exclude = exclude
        self.sizes: dict[tuple[str, int], int] = {}
        self.keep: list[torch.Tensor] = []  # alive until counted, so storage keys stay unique

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.exclude:
            self.sizes[key] = _storage_bytes(t)
        self.keep.append(t)
        return t

    @property
    def total(self) -> int:
        return sum(self.sizes.values())


def _call(module: nn.Module, x: Any) -> Any:
    return call_model(module, x) if isinstance(x, dict) else module(x)


def _next_input(out: Any, name: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise FlowmeshError(
            Code.NOT_A_CHAIN,
            f"block {name!r} returns {type(out).__name__}, not a tensor; only the last block "
            "may return something else",
        )
    out = out.detach()
    return out.requires_grad_() if out.is_floating_point() else out


class _TrainMode:
    """Training (or eval) mode for the duration, then each module's own mode back.

    Dropout and batch-norm save for backward what they save in training, so activations are
    measured in training mode.
    """

    def __init__(self, module: nn.Module, train: bool = True) -> None:
        self.modes = [(m, m.training) for m in module.modules()]
        self.module = module
        self.train = train

    def __enter__(self) -> nn.Module:
        self.module.train(self.train)
        return self.module

    def __exit__(self, *exc: object) -> None:
        for m, mode in self.modes:
            m.training = mode


def _saved_and_output(
    module: nn.Module, x: Any, exclude: set[tuple[str, int]], train: bool
) -> tuple[_SavedTensors, Any]:
    saved = _SavedTensors(exclude)
    with (
        _TrainMode(module, train),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t),
    ):
        out = _call(module, x)
    return saved, out


def _check_served_output(out: Any) -> None:
    """Refuse a model output that serving cannot answer with: what
    `gpu_worker.run_rows.named_outputs` accepts is a tensor, or a mapping holding tensors."""
    if isinstance(out, torch.Tensor):
        return
    if isinstance(out, Mapping) and any(isinstance(v, torch.Tensor) for v in out.values()):
        return
    raise FlowmeshError(
        Code.BAD_REQUEST,
        f"the model returns a {type(out).__name__}"
        f"{' holding no tensor' if isinstance(out, Mapping) else ''}; flowmesh serves models "
        "returning a tensor or a dict of tensors",
    )


def _check_binds(model: nn.Module, inputs: Mapping[str, Any]) -> None:
    """Refuse declared inputs that forward cannot take, the way `call_model` passes them (one
    positionally, several by name)."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no signature to read: nothing to check
        return
    try:
        if len(inputs) == 1:
            sig.bind(None)
        else:
            sig.bind(**{name: None for name in inputs})
    except TypeError as exc:
        declared = (
            f"the declared input {next(iter(inputs))!r} (a single input is passed "
            "positionally) does"
            if len(inputs) == 1
            else f"the declared inputs {list(inputs)} (passed by name) do"
        )
        raise FlowmeshError(
            Code.BAD_REQUEST,
            f"{declared} not fit {type(model).__name__}.forward({', '.join(sig.parameters)}): "
            f"{exc}; declare the inputs forward takes",
        ) from None


def _activations(
    blocks: list[Block], example: Inputs, exclude: set[tuple[str, int]], batch: int
) -> tuple[list[tuple[int, int, tuple[int, ...] | None]], Any]:
    """(out bytes/sample, saved bytes/sample, out shape) per block, on meta; and the last
    block's output (the model's)."""
    out_rows = []
    x: Any = example
    out: Any = None
    for i, block in enumerate(blocks):
        try:
            saved, out = _saved_and_output(block.module, x, exclude, train=True)
        except Exception:
            # Some layers refuse training mode at this shape (batch-norm on one value per
            # channel); what eval mode saves is then the best measure there is.
            try:
                saved, out = _saved_and_output(block.module, x, exclude, train=False)
            except Exception as exc:
                raise FlowmeshError(
                    Code.PLAN_ERROR,
                    f"shape propagation failed in block {i} ({block.name!r}) on the meta "
                    f"device: {type(exc).__name__}: {exc}",
                ) from None
        out_bytes = sum(_nbytes(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        out_rows.append((-(-out_bytes // batch), -(-saved.total // batch), shape))
        if i + 1 < len(blocks):
            x = _next_input(out, block.name)
    return out_rows, out


def _synchronizer(device: torch.device) -> Callable[[], None]:
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None) if device.type != "cpu" else None
    if sync is None:
        return lambda: None
    return lambda: sync(device)


def _median_seconds(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: allocator, kernel selection, lazy initialisation
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@torch.no_grad()
def _fill_random(module: nn.Module) -> None:
    # Values only need to be harmless for the kernels: small weights, unit statistics.
    for p in module.parameters():
        if p.is_floating_point():
            p.normal_(0.0, 0.02)
        else:
            p.zero_()
    for b in module.buffers():
        if b.is_floating_point():
            b.fill_(1.0)
        else:
            b.zero_()


def _backward(out: Any) -> None:
    tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def _times(
    blocks: list[Block], example: Inputs, device: torch.device, repeats: int
) -> list[tuple[float, float]]:
    """(forward s, forward+backward s) per block, measured on `device` one block at a time."""
    sync = _synchronizer(device)
    rows = []
    x: Any = example
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        for i, block in enumerate(blocks):
            module = copy.deepcopy(block.module).to_empty(device=device)
            _fill_random(module)
            module.eval()

            def forward(module: nn.Module = module, x: Any = x) -> Any:
                with torch.no_grad():
                    return _call(module, x)

            fwd = _median_seconds(forward, sync, repeats)
            module.train()

            def train_step(module: nn.Module = module, x: Any = x) -> None:
                module.zero_grad(set_to_none=True)
                _backward(_call(module, x))

            fwd_bwd = _median_seconds(train_step, sync, repeats)
            module.eval()
            if i + 1 < len(blocks):
                x = _next_input(forward(), block.name)
            rows.append((fwd, fwd_bwd))
            del module
    return rows


def _block_bytes(
    model: nn.Module, blocks: list[Block]
) -> tuple[dict[str, int], list[tuple[int, int, int, tuple[str, ...], int]]]:
    """tensor_bytes, and per block (param bytes, buffer bytes, shared bytes, tensor names,
    bytes of the buffers it holds outside the state_dict)."""
    originals = first_names(model)
    state = model.state_dict(keep_vars=True)
    tensor_bytes = {originals[id(t)]: _nbytes(t) for t in state.values()}
    param_names = {originals[id(p)] for p in model.parameters() if id(p) in originals}
    in_state = {id(t) for t in state.values()}
    seen: set[str] = set()
    rows = []
    for block in blocks:
        names = tuple(dict.fromkeys(block.tensor_names.values()))
        own = [n for n in names if n not in seen]
        shared = [n for n in names if n in seen]
        seen.update(own)
        transient = {id(b): b for b in block.module.buffers() if id(b) not in in_state}
        rows.append(
            (
                sum(tensor_bytes[n] for n in own if n in param_names),
                sum(tensor_bytes[n] for n in own if n not in param_names),
                sum(tensor_bytes[n] for n in shared),
                names,
                sum(_nbytes(b) for b in transient.values()),
            )
        )
    return tensor_bytes, rows


def _weight_storages(model: nn.Module) -> set[tuple[str, int]]:
    tensors: Iterable[torch.Tensor] = [*model.parameters(), *model.buffers()]
    return {_storage_key(t) for t in tensors}


def profile(
    spec: ModelSpec,
    *,
    batch: int = 1,
    seq_len: int = 1,
    measure_device: str | torch.device | None = None,
    allow: Iterable[str] = DEFAULT_ALLOW,
    repeats: int = 5,
    serving: bool = True,
) -> ModelProfile:
    """Profile `spec`'s chain of blocks.

    Activation fields are per sample at `batch`, with free input dimensions (sequence length)
    set to `seq_len`. With `measure_device`, each block's forward (no grad, eval mode) and
    forward+backward (train mode) are timed there: the median of `repeats` runs after a warm-up,
    on random weights. A model that declares no inputs gets bytes only: activation fields are 0
    and nothing is timed (there is nothing to run it on).

    With `serving` (the default), a model whose output serving cannot answer with (a tuple, say:
    see `_check_served_output`) is refused here, at plan time, rather than on every request;
    training, which takes the first tensor of a tuple, profiles with `serving=False`. Declared
    inputs that forward cannot take are refused too, even for a model served uncut.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise FlowmeshError(Code.BAD_REQUEST, f"batch must be a positive integer, got {batch!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise FlowmeshError(
            Code.BAD_REQUEST, f"seq_len must be a positive integer, got {seq_len!r}"
        )
    model = build_meta(spec, allow)
    inputs = declared_inputs(spec, model)
    meta_example = make_inputs(inputs, 1, seq_len, "meta") if inputs is not None else None
    blocks = chain_of(model, meta_example)
    tensor_bytes, byte_rows = _block_bytes(model, blocks)

    activations: list[tuple[int, int, tuple[int, ...] | None]] = [(0, 0, None)] * len(blocks)
    times: list[tuple[float | None, float | None]] = [(None, None)] * len(blocks)
    device = None
    if inputs is not None:
        example = make_inputs(inputs, batch, seq_len, "meta")
        try:
            activations, out = _activations(blocks, example, _weight_storages(model), batch)
        except FlowmeshError as exc:
            if blocks[0].uncut is None or exc.code != Code.PLAN_ERROR:
                raise
            # Its one block is the model: inputs it cannot even be called with are the
            # request's mistake, not the model's control flow.
            _check_binds(model, example)
            # A model that could not be traced often cannot run on meta either (its values
            # steer it): its one block is served whole, so activation sizes stay unknown (0).
            activations = [(0, 0, None)]
        else:
            if serving:
                _check_served_output(out)
        if measure_device is not None:
            device = torch.device(measure_device)
            if device.type == "meta":
                raise FlowmeshError(Code.BAD_REQUEST, "cannot time blocks on the meta device")
            real = make_inputs(inputs, batch, seq_len, device, random=True)
            times = list(_times(blocks, real, device, repeats))

    return ModelProfile(
        spec_digest=spec.digest(),
        blocks=tuple(
            BlockProfile(
                name=block.name,
                param_bytes=params,
                buffer_bytes=buffers,
                shared_bytes=shared,
                out_bytes_per_sample=out_b,
                saved_bytes_per_sample=saved_b,
                out_shape=shape,
                forward_s=fwd,
                forward_backward_s=fwd_bwd,
                tensors=names,
                transient_bytes=transient,
            )
            for block, (params, buffers, shared, names, transient), (out_b, saved_b, shape), (
                fwd,
                fwd_bwd,
            ) in zip(blocks, byte_rows, activations, times, strict=True)
        ),
        tensor_bytes=tensor_bytes,
        batch=batch,
        seq_len=seq_len,
        inputs=None
        if inputs is None
        else {n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in inputs.items()},
        device=None if device is None else str(device),
        uncut=blocks[0].uncut,
    )


# -- profile, then plan ----------------------------------------------------------------------------


def profile_for(
    spec: ModelSpec,
    given: ModelProfile | None,
    *,
    batch: int,
    seq_len: int,
    measure_device: Any,
    allow: Iterable[str],
    serving: bool = True,
) -> ModelProfile:
    """`given`, checked to be a profile of `spec`; without one, a fresh profile of `spec`
    (`serving`: see `profile`)."""
    if given is not None:
        if given.spec_digest != spec.digest():
            raise FlowmeshError(
                Code.PLAN_ERROR,
                f"the profile is of model digest {given.spec_digest}, not {spec.digest()}",
            )
        return given
    return profile(
        spec,
        batch=batch,
        seq_len=seq_len,
        measure_device=measure_device,
        allow=allow,
        serving=serving,
    )


def make_chunk_plan(
    spec: ModelSpec,
    target_bytes: int,
    optimizer: str | Mapping[str, Any],
    batch: int,
    *,
    seq_len: int = 1,
    measure_device: Any = None,
    allow: Iterable[str] = DEFAULT_ALLOW,
    profile: ModelProfile | None = None,
) -> Plan:
    """Profile `spec` at the job's batch size (unless `profile` is given) and plan its chunks."""
    prof = profile_for(
        spec,
        profile,
        batch=batch,
        seq_len=seq_len,
        measure_device=measure_device,
        allow=allow,
        serving=False,
    )
    return chunk_plan(prof, target_bytes, optimizer, batch, state_count(optimizer, allow))
