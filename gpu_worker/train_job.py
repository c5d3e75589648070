"""One training job on a worker: the sub-model tasks of a step and their compute.

The model is a chain of blocks cut into contiguous sub-models (a chunk plan), each with a host
slab of the tensors it owns (`gpu_worker.train_layout`: the slab's sections, a task's extent in
the arena, the copies that bring it in). While a task computes, the module's own Parameter
and buffer objects are rebound (`.data`) to arena views, gradients accumulate into arena views
(on the CPU stand-in a first gradient is made afresh: `TrainingJob.fresh_grads`) and the torch
optimizer reads and updates its state there; afterwards everything is rebound to
its host home. Object identity never changes, so a per-sub-model `torch.optim` optimizer does the
exact maths of the same optimizer in plain PyTorch.

A step with k sub-models and N micro-batches is, per micro-batch,

    forward 0 .. k-2 (input kept)  ->  last k-1 (forward, loss, backward)
    ->  backward k-2 .. 0 (backward with the incoming gradient)

where each sub-model's backward either recomputes its forward from the kept input (its forward
ran without grad) or runs the graph its forward kept (`gpu_worker.activation_keep`: the policy,
chosen per sub-model by measured cost, or forced by `TrainConfig.activations`)

and the optimizer update of a sub-model runs at the end of its last micro-batch's backward, or,
with gradient clipping, in a second pass of update tasks once every gradient (hence the global
norm) is known. What makes it exact:

- randomness: each forward starts from the job's own RNG state (saved before, advanced after),
  and the backward's recompute restores the state that forward started from: dropout draws the
  same mask. Jobs never share RNG streams, so interleaving changes nothing.
- buffers: the recompute runs on the buffers as the forward saw them (a snapshot taken by the
  forward task) and never writes them back: BatchNorm statistics move once per forward.
- tied weights: the owner is the lowest-indexed user, which the backward order reaches last;
  other users accumulate into the shared gradient home; only the owner updates.
- parameters that get no gradient keep `grad=None` for the optimizer (as after `zero_grad()`),
  seen through post-accumulate-grad hooks, so they are skipped exactly as in plain PyTorch.
- mixed precision (`compute_dtype` "bfloat16"): the forward, its recompute and the loss run under
  one and the same `torch.autocast`, the backward and the update outside it, on the float32
  parameters and gradients, as a PyTorch AMP loop does; the host tier keeps float32 masters.
  An activation kept between sub-models is the sub-model's output as autocast made it (bfloat16
  after a matmul), as the next layer of the plain model receives it.
"""

from __future__ import annotations

import collections
import math
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

from flowmesh.errors import Code, FlowmeshError, bad_request
from flowmesh.modelio.chain import Block
from flowmesh.modelio.dtypes import TORCH_DTYPES
from flowmesh.modelio.inputs import call_model
from flowmesh.optimizers import step_adopting
from flowmesh.spec import BLOCK_ALIGN, TENSOR_ALIGN, TensorSpec
from flowmesh.steps import StepResult
from gpu_worker.activation_keep import (
    KEEP,
    NO_POLICY,
    RECOMPUTE,
    SELECTIVE,
    ChangedInPlace,
    KeptGraph,
    NotRepeated,
    SelectiveForward,
    Stash,
    choose,
)
from gpu_worker.device import TRAIN_LANE, TRAIN_STASH_LANE, Device
from gpu_worker.host_tier import Slot, view_of
from gpu_worker.model_code import MODEL_CODE_LOCK
from gpu_worker.train_checkpoint import save_checkpoint
from gpu_worker.train_config import (
    TrainConfig,
    checked_loss,
    make_optimizer,
    optimizer_states,
    resolve_loss,
)
from gpu_worker.train_layout import (
    BACKWARD,
    EVAL,
    FORWARD,
    LAST,
    SAVE,
    UPDATE,
    CopyPlan,
    Layout,
    Region,
    SubModel,
    TensorInfo,
    aligned,
    check_ranges,
    collect,
    lay_out_slab,
    layout_for,
    plan_copies,
    regions,
    task_layouts,
)
from gpu_worker.train_scheduler import ANY, Task

Inputs = torch.Tensor | dict[str, torch.Tensor]
# A sub-model's steps between two rounds of measuring every activation policy ("auto"): its
# first measurements are of cold steps (first allocations, first kernels), and costs drift
# (serving beside training), so they are taken again; a round costs at most two steps under
# another policy than the cheapest.
REMEASURE_EVERY = 32
# Bytes of a job's stashes on their way to the host at once (`_stash`): device memory torch's
# allocator holds for each until its copy landed, outside what the tasks reserve. Past it, the
# compute lane waits for the oldest to land.
STASH_IN_FLIGHT_BYTES = 64 << 20
RngState = tuple[torch.Tensor, torch.Tensor | None]


@dataclass
class TaskResult:
    loss: float | None = None
    nonfinite: bool = False
    value: Any = None  # what a checkpoint task returns
    bytes_out: int = 0


def no_pause() -> None:
    """A job driven without a serving gate never waits (and its backward gets no pause hooks)."""


def _model_error(job: str, where: str, exc: BaseException) -> FlowmeshError:
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" ({frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno})" if frames else ""
    return FlowmeshError(
        Code.MODEL_ERROR, f"job {job!r}: {where} raised {type(exc).__name__}: {exc}{at}"
    )


def _rng_get(cuda: int | None) -> RngState:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(cuda) if cuda is not None else None)


def _rng_set(state: RngState, cuda: int | None) -> None:
    torch.set_rng_state(state[0])
    if cuda is not None and state[1] is not None:
        torch.cuda.set_rng_state(state[1], cuda)


@contextmanager
def _rng_scope(state: RngState, cuda: int | None) -> Iterator[None]:
    """Run with the global generators at `state`, then put the caller's state back."""
    outer = _rng_get(cuda)
    _rng_set(state, cuda)
    try:
        yield
    finally:
        _rng_set(outer, cuda)


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in TORCH_DTYPES.items():
        if d == dtype:
            return name
    return str(dtype).removeprefix("torch.")


def _batch_of(inputs: Inputs) -> int:
    tensors = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs.values())
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise bad_request("inputs must be a tensor or a non-empty mapping of names to tensors")
    if any(t.dim() == 0 for t in tensors):
        raise bad_request("inputs need a batch dimension (dim 0)")
    sizes = {int(t.shape[0]) for t in tensors}
    if len(sizes) != 1:
        raise bad_request(f"inputs disagree on the batch size: {sorted(sizes)}")
    return sizes.pop()


def _split(inputs: Inputs, n: int) -> list[Inputs]:
    if isinstance(inputs, torch.Tensor):
        return list(inputs.chunk(n))
    parts = {k: v.chunk(n) for k, v in inputs.items()}
    return [{k: parts[k][i] for k in inputs} for i in range(n)]


def _split_rows(inputs: Inputs, rows: int) -> list[Inputs]:
    """`inputs` in pieces of `rows` rows (the last may have fewer)."""
    if isinstance(inputs, torch.Tensor):
        return list(inputs.split(rows))
    parts = {k: v.split(rows) for k, v in inputs.items()}
    return [{k: parts[k][i] for k in inputs} for i in range(len(next(iter(parts.values()))))]


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides for `shape`."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _as_output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise FlowmeshError(
        Code.MODEL_ERROR,
        f"the model returned {type(out).__name__}; training needs a tensor (or logits)",
    )


class TrainingJob:
    """A model's sub-models, their host tier and optimizers, and the compute of each task.

    `blocks` is the model's chain (`flowmesh.modelio.chain.chain_of`) and `ranges` the sub-models'
    block ranges (a chunk plan's `ranges`). `act_bytes[i]` / `fwd_bytes[i]` are the activation
    bytes a backward / forward task of sub-model i holds besides its tensors (from the model's
    profile; see `gpu_worker.train_executor.open_job`); they are reserved in the arena so that the
    budget accounts for them. Calls into a job come from one executor: the driver thread plans
    copies, the compute lane runs tasks, never two tasks of one job at once. `allow` is the
    worker's allow-list for a loss factory (`resolve_loss`).
    """

    def __init__(
        self,
        name: str,
        blocks: Sequence[Block],
        ranges: Sequence[tuple[int, int]],
        config: TrainConfig,
        device: Device,
        *,
        inputs: Mapping[str, TensorSpec] | None = None,
        act_bytes: Sequence[int] | None = None,
        fwd_bytes: Sequence[int] | None = None,
        allow: Iterable[str] | None = None,
    ) -> None:
        self.name = name
        self.config = config
        # Resolved at open: a refused or broken loss factory fails the open, not a step.
        self.loss_fn = resolve_loss(config.loss, allow)
        self.allow = None if allow is None else tuple(allow)
        self.device = device
        self.inputs = dict(inputs) if inputs is not None else None
        self.ranges = [(int(a), int(b)) for a, b in ranges]
        check_ranges(self.ranges, len(blocks))
        k = len(self.ranges)
        self.act_bytes = list(act_bytes) if act_bytes is not None else [0] * k
        self.fwd_bytes = list(fwd_bytes) if fwd_bytes is not None else [0] * k
        if len(self.act_bytes) != k or len(self.fwd_bytes) != k:
            raise bad_request(f"act_bytes and fwd_bytes need one entry per sub-model ({k})")
        # Mixed precision: the dtype autocast computes the forward and the loss in (`_compute`);
        # None with float32, where nothing is cast.
        self._autocast: torch.dtype | None = (
            None if config.compute_dtype == "float32" else TORCH_DTYPES[config.compute_dtype]
        )
        self._cuda = device.torch_device.index if device.kind == "cuda" else None
        if self._cuda is None and device.kind == "cuda":
            self._cuda = torch.cuda.current_device()
        self.tensors: dict[str, TensorInfo]
        self.subs: list[SubModel]
        self.tensors, self.subs = collect(blocks, self.ranges)
        for m in (mod for sub in self.subs for mod in sub.modules):
            m.train()
        # Flags read when copies are planned: which homes hold something worth copying in.
        self.grad_valid: dict[str, bool] = {
            n: False for n, i in self.tensors.items() if i.trainable
        }
        self.state_valid: dict[str, bool] = dict(self.grad_valid)
        self._make_slabs()
        self._make_optimizers()
        for sub in self.subs:
            i = sub.index
            sub.layouts = task_layouts(sub, self.tensors, self.fwd_bytes[i], self.act_bytes[i])
        # The names of parameters a backward gave a gradient (their hooks, `_touch`).
        self._touched: set[str] = set()
        for info in self.tensors.values():
            if info.trainable:
                info.tensor.register_post_accumulate_grad_hook(self._touch(info.name))

        self.step_count = 0
        self.last_loss: float | None = None
        self.broken: str | None = None
        # The batch the activation reservations were planned for (`open_job`'s, set by the
        # worker): a step of more rows is refused, as its activations would outgrow what the
        # budget counts for them, and an evaluation of more is cut into more micro-batches.
        # None: not known, nothing checked (a job built by hand).
        self.batch: int | None = None
        gen = torch.Generator().manual_seed(config.seed)
        cuda_state = None
        if self._cuda is not None:
            cuda_gen = torch.Generator(device=f"cuda:{self._cuda}").manual_seed(config.seed)
            cuda_state = cuda_gen.get_state()
        self.rng: RngState = (gen.get_state(), cuda_state)
        # Per step (request id): micro-batches, kept inputs, incoming gradients, replay contexts.
        self._data: dict[int, tuple[list[Inputs], list[torch.Tensor]]] = {}
        self._acts: dict[tuple[int, int, int], Any] = {}
        self._grads: dict[tuple[int, int, int], torch.Tensor] = {}
        self._replay: dict[tuple[int, int, int], tuple[RngState, torch.Tensor | None]] = {}
        # Kept forwards (policies KEEP and SELECTIVE): the input and output whose graph the
        # backward runs (a selective one's recomputes its forward from that input on the way),
        # and what the forward stashed for it (`prefetch`).
        self._kept: dict[
            tuple[int, int, int], tuple[Any, torch.Tensor, KeptGraph | SelectiveForward]
        ] = {}
        # Stashes whose copy to the host has not landed yet, oldest first, and their bytes
        # (`_stash`, on the compute lane).
        self._stashing: collections.deque[tuple[int, Any]] = collections.deque()
        self._stashing_bytes = 0
        # The admission (its copy plan) of the task computing (`run`, `prefetch`).
        self._admission: object = None
        # Per sub-model: what its last selective backward left of its forward's stash, per
        # operation (`SelectiveForward.unread`): not brought back ahead of the next one.
        self._unread: list[dict[Any, int]] = [{} for _ in range(k)]
        # Per sub-model: the policy of the step planned last, and what each policy's tasks
        # cost ([seconds, tasks] per policy) and what a kept or selective forward stashed, per
        # policy (`observe`, `choose`).
        forced = self.config.activations
        self._policy: list[str] = [RECOMPUTE if forced == "auto" else forced] * k
        self._cost: list[dict[str, list[float]]] = [{} for _ in range(k)]
        self._saved: list[dict[str, int]] = [{} for _ in range(k)]
        # Per (step, sub-model): the policy its tasks run with (`_policy_of`); per sub-model,
        # the policies chosen so far (a new round of measurements every REMEASURE_EVERY).
        self._step_policy: dict[tuple[int, int], str] = {}
        self._chosen = [0] * k
        self._losses: dict[int, list[float]] = {}
        self._nonfinite: dict[int, bool] = {}
        self._updated: set[int] = set()
        self._norms: dict[str, torch.Tensor] = {}
        self._total_norm: dict[int, torch.Tensor] = {}
        self._correct: dict[int, list[int]] = {}  # eval request -> [right, counted] predictions
        # An evaluation cut into more micro-batches than a step's (over the job's batch): its
        # rows, by which each micro-batch's loss is weighed.
        self._eval_rows: dict[int, int] = {}
        # A yield point: called on the compute lane between the blocks of a task's forward and
        # backward and before its update, where the task may wait for serving to go quiet (the
        # executor sets it per task: `TrainingExecutor`'s serving gate). Waiting there changes
        # nothing the task computes, only when.
        self.pause: Callable[[], None] = no_pause
        # Typed views of the arena by (address, dtype), made once (`_view`).
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # Write-backs to the host tier. Deferred (an executor's job): a task's are queued here
        # as (host home, arena bytes) and the executor copies them after its compute, off the
        # compute lane (`TrainingExecutor`'s write lane), so that the next task computes
        # meanwhile. Until then `written` holds, per host region the task wrote (`regions`),
        # the marker set once they are copied: whatever reads that region waits on it.
        self.defer_writes = False
        # Where a backward's gradients go when none has accumulated yet. On a device, into
        # their arena views, zeroed first: the arena is what bounds the device's memory. On
        # the CPU stand-in nothing is bounded, and zero-filling the views then adding into them
        # costs two more passes over the gradients' memory than letting autograd make them, as
        # plain PyTorch after `zero_grad()` does (BENCHMARKS.md, "fresh gradients"): they are
        # made afresh there, and copied into their views only when they outlive the task (an
        # update in a later task, or a later micro-batch accumulating into them).
        # `_fresh`: the owned parameters of the task under way that start without a gradient.
        self.fresh_grads = self.device.kind == "cpu"
        self._fresh: list[TensorInfo] = []
        self._writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.written: dict[Any, Any] = {}
        self.last_write: Any = None  # the executor's record of the last task that wrote back

    # -- construction ------------------------------------------------------------------------

    def _make_slabs(self) -> None:
        """Each sub-model's slab, laid out (`lay_out_slab`) and filled: the host tier now holds
        the only copy of every tensor."""
        for sub in self.subs:
            infos = [self.tensors[n] for n in sub.owned]
            trainable = [i.tensor for i in infos if i.is_param and i.trainable]
            slots = optimizer_states(self.config, trainable, self.allow)
            size = lay_out_slab(sub, self.tensors, slots)
            sub.slab = self.device.host_buffer(max(size, 1))
            with torch.no_grad():
                for info in infos:
                    info.home = view_of(sub.slab, info.slot.offset, info.slot)
                    info.home.copy_(info.tensor.detach())
                    info.tensor.data = info.home  # the host tier now holds the only copy
                    if info.grad_slot is not None:
                        info.grad_home = view_of(sub.slab, info.grad_slot.offset, info.grad_slot)
                    info.state_homes = {
                        k: view_of(sub.slab, s.offset, s) for k, s in info.state_slots.items()
                    }

    def _make_optimizers(self) -> None:
        for sub in self.subs:
            params = [self.tensors[n].tensor for n in sub.owned if self.tensors[n].trainable]
            if not params:
                continue
            sub.optimizer = make_optimizer(self.config.optimizer, params, self.allow)
            # An optimizer that makes its state as it is built (Adagrad's sums) hands it to the
            # host tier now, as others do at their first update: from here on the home holds it.
            for n in sub.owned:
                info = self.tensors[n]
                state = sub.optimizer.state.get(info.tensor)
                if info.trainable and state and all(k in state for k in info.state_homes):
                    with torch.no_grad():
                        for key, home in info.state_homes.items():
                            home.copy_(state[key])
                            state[key] = home
                    self.state_valid[n] = bool(info.state_homes)

    def _touch(self, name: str) -> Callable[[torch.Tensor], None]:
        # The set, not the job: a hook kept by a tensor that held the job would keep a closed
        # job, its modules and its host tier alive for the worker's life.
        touched = self._touched

        def hook(_: torch.Tensor) -> None:
            touched.add(name)

        return hook

    # -- facts -------------------------------------------------------------------------------

    @property
    def parts(self) -> int:
        return len(self.subs)

    def largest_task(self) -> int:
        return max(layout.total for sub in self.subs for layout in sub.layouts.values())

    def sub_model_info(self) -> list[dict[str, Any]]:
        """Per sub-model: its block range [start, stop), host-tier bytes (parameters, gradients'
        home, optimizer state, buffers), the arena bytes its largest task takes (those plus
        the activation reservation) and its activation policy."""
        return [
            {
                "blocks": [sub.start, sub.stop],
                "host_bytes": int(sub.slab.numel()),
                "task_bytes": max(layout.total for layout in sub.layouts.values()),
                "activations": self.activation_policy(sub.index),
            }
            for sub in self.subs
        ]

    def activation_policy(self, i: int) -> str:
        """What sub-model i's backward does for its forward's activations, as chosen last
        (`gpu_worker.activation_keep`): every sub-model but the last has a FORWARD task and a
        BACKWARD task that either recomputes the forward from its kept input or runs the kept
        graph (whole or selectively); the last runs both in its LAST task."""
        return NO_POLICY if i == self.parts - 1 else self._policy[i]

    def stashed_bytes(self, i: int) -> dict[str, int]:
        """What sub-model i's last forward stashed for its backward, per policy that keeps
        something from it ("keep", "selective"), as `choose` weighs it against the room."""
        return dict(self._saved[i])

    def _policy_of(self, task: Task) -> str:
        """The activation policy of a FORWARD or BACKWARD task (set in its payload, for
        `observe`): its sub-model's in its step, chosen when the step's first forward of that
        sub-model runs, from the costs measured until then (not when the step was planned:
        steps sent together are planned before any of them ran), and the same for the step's
        other micro-batches and for the backward."""
        key = (task.request, task.sub)
        policy = self._step_policy.get(key)
        if policy is None:
            policy = self._step_policy[key] = self._choose_policy(task.sub)
            self._policy[task.sub] = policy
        task.payload["policy"] = policy
        return policy

    def _choose_policy(self, i: int) -> str:
        forced = self.config.activations
        if forced != "auto":
            return forced
        self._chosen[i] += 1
        if self._chosen[i] % REMEASURE_EVERY == 0:
            self._cost[i].clear()  # `choose` measures each again, then takes the cheapest
        # Every micro-batch's forward stashes as much, held until its backward, and the job's
        # other sub-models' stashes (under their latest policies) are held at the same time: a
        # job's kept graphs take at most its own host tier's bytes.
        n = self.config.accumulate
        others = sum(
            self._saved[j].get(self._policy[j], 0) for j in range(self.parts - 1) if j != i
        )
        room = max(self.host_bytes() - others * n, 0)
        mean: dict[str, float | None] = {p: s / k for p, (s, k) in self._cost[i].items() if k}
        saved: dict[str, int | None] = {p: b * n for p, b in self._saved[i].items()}
        return choose(mean, saved, room)

    def observe(self, task: Task, seconds: float) -> None:
        """A FORWARD or BACKWARD task's compute seconds (the executor's clock), under the policy
        it ran with: what `choose` weighs."""
        policy = task.payload.get("policy")
        if policy is None:
            return
        cost = self._cost[task.sub].setdefault(policy, [0.0, 0])
        cost[0] += seconds
        cost[1] += 1

    def host_bytes(self) -> int:
        return sum(sub.slab.numel() for sub in self.subs)

    def footprint(self) -> int:
        """Bytes the whole job would hold on a device at once: every slab, the activation
        reservation of its largest sub-model (what temporal sharing needs)."""
        return self.host_bytes() + max(self.act_bytes)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's tensors by original name, as the host tier holds them (views, no copy),
        once the write-backs of the tasks that ran are in."""
        self.wait_written()
        return {name: info.home for name, info in self.tensors.items()}

    def wait_written(self, regions: Iterable[Any] | None = None) -> None:
        """Wait, on this thread, until the write-backs to `regions` (None: all) are in."""
        keys = list(self.written) if regions is None or ANY in regions else regions
        for key in keys:
            marker = self.written.get(key)
            if marker is not None:
                marker.wait()

    def _write_back(self, home: torch.Tensor, arena_bytes: torch.Tensor) -> None:
        """Copy `arena_bytes` to their `home` in the host tier: now, or queued for the
        executor (`defer_writes`)."""
        if self.defer_writes:
            self._writes.append((home, arena_bytes))
        else:
            home.copy_(arena_bytes)

    def take_writes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The write-backs the last task queued (`defer_writes`), in the order it made them."""
        writes, self._writes = self._writes, []
        return writes

    # -- planning a step ---------------------------------------------------------------------

    def begin_step(self, request: int, inputs: Inputs, targets: torch.Tensor) -> None:
        """Validate a step's batch and keep its micro-batches until the step ends. A batch over
        the one the job was opened for (`batch`) is refused: its activations would outgrow
        the memory planned for them."""
        self._begin(request, inputs, targets)

    def begin_eval(self, request: int, inputs: Inputs, targets: torch.Tensor) -> None:
        """Validate an evaluation's batch and keep its micro-batches until it ends. It is split
        like a step's so that each task's activations stay within the reservation a forward
        task of the job was planned with; one over the job's `batch` is cut into more of them,
        each of at most a step's micro-batch (its loss weighs each by its rows)."""
        self._begin(request, inputs, targets, evaluating=True)
        self._correct[request] = [0, 0]

    def _begin(
        self, request: int, inputs: Inputs, targets: torch.Tensor, evaluating: bool = False
    ) -> None:
        if self.broken is not None:
            raise bad_request(
                f"job {self.name!r} is broken ({self.broken}); resume from a checkpoint"
            )
        batch = _batch_of(inputs)
        if self.inputs is not None:
            given = {"": inputs} if isinstance(inputs, torch.Tensor) else inputs
            if isinstance(inputs, torch.Tensor) and len(self.inputs) == 1:
                given = {next(iter(self.inputs)): inputs}
            if set(given) != set(self.inputs):
                raise bad_request(f"inputs {sorted(given)}: the model takes {sorted(self.inputs)}")
            for n, spec in self.inputs.items():
                t = given[n]
                spec.check(n, _dtype_name(t.dtype), tuple(t.shape))
        if not isinstance(targets, torch.Tensor) or targets.dim() == 0:
            raise bad_request("targets must be a tensor with a batch dimension")
        if int(targets.shape[0]) != batch:
            raise bad_request(f"targets have {int(targets.shape[0])} rows for a batch of {batch}")
        n = self.config.accumulate
        over = self.batch is not None and batch > self.batch
        if over and not evaluating:
            raise bad_request(
                f"a batch of {batch} is over the batch of {self.batch} job {self.name!r} "
                "was opened for (its memory was planned for that many rows): send at most "
                f"{self.batch}, or open a job for {batch}"
            )
        if evaluating and (over or batch % n):
            # An evaluation takes any number of rows: in micro-batches of at most a step's.
            micro = max(1, (self.batch or batch) // n)
            self._data[request] = (_split_rows(inputs, micro), list(targets.split(micro)))
            self._eval_rows[request] = batch
        elif batch % n:
            raise bad_request(f"a batch of {batch} does not split into {n} equal micro-batches")
        else:
            self._data[request] = (_split(inputs, n), list(targets.chunk(n)))
        self._losses[request] = []
        self._nonfinite[request] = False

    def _task(self, request: int, kind: str, i: int, micro: int, update: bool) -> Task:
        sub = self.subs[i]
        layout = layout_for(sub, kind, update)
        clip = self.config.clip_grad_norm is not None
        reads, writes = regions(kind, sub, self.tensors, update, clip)
        task = Task(self.name, request, kind, layout.total, reads, writes, sub=i, micro=micro)
        task.payload = {"update": update}
        if kind in (FORWARD, BACKWARD):
            task.payload["policy"] = None  # chosen when it runs (`_policy_of`)
        return task

    def plan_step(self, request: int) -> list[Task]:
        """The chain of tasks of one step (see the module docstring)."""
        k, n = self.parts, self.config.accumulate
        clip = self.config.clip_grad_norm is not None
        tasks: list[Task] = []
        for m in range(n):
            update = m == n - 1 and not clip
            tasks += [self._task(request, FORWARD, i, m, False) for i in range(k - 1)]
            tasks.append(self._task(request, LAST, k - 1, m, update))
            tasks += [self._task(request, BACKWARD, i, m, update) for i in range(k - 2, -1, -1)]
        if clip:
            # Sub-model 0 first: the next step's first forward reads what it writes.
            tasks += [
                self._task(request, UPDATE, i, n - 1, True)
                for i in range(k)
                if self.subs[i].optimizer is not None
            ]
        tasks[-1].last = True
        return tasks

    def plan_eval(self, request: int) -> list[Task]:
        """A forward of every sub-model per micro-batch, the loss at the end of the last."""
        tasks = [
            self._task(request, EVAL, i, m, False)
            for m in range(len(self._data[request][0]))
            for i in range(self.parts)
        ]
        tasks[-1].last = True
        return tasks

    def plan_save(self, request: int, path: Any) -> list[Task]:
        task = Task(self.name, request, SAVE, 0, frozenset({ANY}), frozenset(), last=True)
        task.payload = {"path": path}
        return [task]

    # -- copies (driver thread) ----------------------------------------------------------------

    def copy_plan(self, task: Task, base: int) -> CopyPlan:
        """Copies that bring the task's data from the host tier into its extent at `base`."""
        if task.kind == SAVE:
            return CopyPlan()
        replay = self._replay.get((task.request, task.micro, task.sub))
        snapshot = replay[1] if replay is not None else None
        if task.kind == BACKWARD and replay is None:
            # A kept forward's backward runs no forward: the buffers only as they are now
            # (what its graph saved of them, BatchNorm's running statistics, the backward of a
            # training-mode forward does not read).
            b0, b1 = self.subs[task.sub].sections["B"]
            snapshot = self.subs[task.sub].slab[b0:b1]
        return plan_copies(
            self.subs,
            self.tensors,
            task.sub,
            task.kind,
            bool(task.payload["update"]),
            base,
            grad_valid=self.grad_valid,
            state_valid=self.state_valid,
            snapshot=snapshot if task.kind == BACKWARD else None,
            fresh_grads=self.fresh_grads,
        )

    def _layout(self, task: Task) -> Layout:
        return layout_for(self.subs[task.sub], task.kind, bool(task.payload["update"]))

    # -- compute (compute lane) ----------------------------------------------------------------

    def run(self, task: Task, base: int, plan: CopyPlan, arena: torch.Tensor) -> TaskResult:
        """Compute one task whose copies are done, with its extent at `base` of `arena`."""
        if task.kind == SAVE:
            self.wait_written()
            return TaskResult(value=save_checkpoint(self, task.payload["path"]))
        for off, size in plan.zero:
            arena[off : off + size].zero_()
        sub = self.subs[task.sub]
        with MODEL_CODE_LOCK:
            bound = self._bind(task, sub, base, arena)
            self._admission = plan  # whose stashes brought ahead are this task's (`_unstash`)
            try:
                if task.kind == FORWARD:
                    return self._run_forward(task, sub, base, arena, bound)
                if task.kind == EVAL:
                    return self._run_eval(task, sub)
                if task.kind == UPDATE:
                    return self._run_update(task, sub, base, arena)
                return self._run_backward(task, sub, base, arena)
            finally:
                self._admission = None
                self._unbind(bound)

    def _view(self, arena: torch.Tensor, offset: int, slot: Slot) -> torch.Tensor:
        """`view_of(arena, offset, slot)` as one `as_strided` on a typed view of the arena made
        once per dtype: a task binds several views per tensor, and `view_of`'s three view ops
        cost three times one (BENCHMARKS.md, "where memory flow's fixed costs go")."""
        item = slot.dtype.itemsize
        at = arena.storage_offset() + offset  # bytes from the arena storage's start
        if not slot.nbytes or at % item:
            return view_of(arena, offset, slot)
        key = (arena.data_ptr(), slot.dtype)
        typed = self._typed.get(key)
        if typed is None:
            start = (-arena.storage_offset()) % item  # a typed view starts on an element
            usable = (arena.numel() - start) // item * item
            typed = self._typed[key] = arena[start : start + usable].view(slot.dtype)
        return typed.as_strided(slot.shape, _strides(slot.shape), at // item)

    def _bind(self, task: Task, sub: SubModel, base: int, arena: torch.Tensor) -> list[TensorInfo]:
        layout = self._layout(task)
        grads = task.kind in (LAST, BACKWARD)
        names = (
            sub.owned if task.kind != UPDATE else [n for n in sub.owned if self.tensors[n].is_param]
        )
        bound: list[TensorInfo] = []
        self._fresh = []
        fresh = grads and self.fresh_grads
        try:
            for n in [*names, *layout.borrowed]:
                info = self.tensors[n]
                off = (
                    base + info.slot.offset
                    if n not in layout.borrowed
                    else base + layout.borrowed[n]
                )
                info.tensor.data = self._view(arena, off, info.slot)
                bound.append(info)
                if info.trainable and (grads or task.kind == UPDATE):
                    if fresh and n not in layout.borrowed and not self.grad_valid[n]:
                        info.tensor.grad = None  # autograd makes it (`fresh_grads`)
                        self._fresh.append(info)
                        continue
                    if n in layout.borrowed:
                        goff = base + layout.borrowed_grads[n]
                    else:
                        assert info.grad_slot is not None
                        goff = base + info.grad_slot.offset
                    info.tensor.grad = self._view(arena, goff, info.grad_slot or info.slot)
            if task.payload.get("update") and sub.optimizer is not None:
                for n in sub.owned:
                    info = self.tensors[n]
                    if info.trainable and self.state_valid[n]:
                        state = sub.optimizer.state[info.tensor]
                        for key, s in info.state_slots.items():
                            state[key] = self._view(arena, base + s.offset, s)
        except BaseException:
            self._unbind(bound)
            raise
        return bound

    def _unbind(self, bound: list[TensorInfo]) -> None:
        for info in bound:
            info.tensor.grad = None
            info.tensor.data = info.home
            if info.state_homes:
                opt = self.subs[info.owner].optimizer
                state = opt.state.get(info.tensor) if opt is not None else None
                if state:
                    for key, home in info.state_homes.items():
                        if key in state:
                            state[key] = home

    @contextmanager
    def _model_code(self, task: Task) -> Iterator[None]:
        """User model code runs inside: its exceptions become this job's MODEL_ERROR, naming
        the task (our own FlowmeshErrors pass through as they are)."""
        try:
            yield
        except FlowmeshError:
            raise
        except Exception as exc:
            raise _model_error(self.name, self._where(task), exc) from None

    def _compute(self) -> AbstractContextManager[Any]:
        """Where a task's forward and loss run: under autocast to the job's compute dtype,
        entered alike by a forward, its recompute and an evaluation; nothing with float32."""
        if self._autocast is None:
            return nullcontext()
        return torch.autocast(self.device.torch_device.type, dtype=self._autocast)

    def _forward(self, sub: SubModel, x: Any) -> torch.Tensor:
        out = x
        # No gate, no yield point: the backward then calls no Python hook per block.
        hooked = torch.is_grad_enabled() and self.pause is not no_pause
        for j, module in enumerate(sub.modules):
            if j:
                self.pause()
                if hooked and isinstance(out, torch.Tensor) and out.requires_grad:
                    # The same yield point in the backward, at the same block boundary: the
                    # hook returns None, so the gradient passing through is left as it is.
                    out.register_hook(self._pause_hook)
            out = call_model(module, out) if sub.index == 0 and j == 0 else module(out)
        return _as_output(out)

    def _computed_forward(self, sub: SubModel, x: Any) -> torch.Tensor:
        """A selective forward's (and its recompute's): on a copy of its input, which checkpoint
        keeps to run it again from, so that a forward changing its input in place (a clamp_ on
        the batch) leaves that as it was."""
        if isinstance(x, torch.Tensor):
            x = x.clone()
        elif isinstance(x, Mapping):
            x = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in x.items()}
        with self._compute():
            return self._forward(sub, x)

    @contextmanager
    def _repeated(self, task: Task) -> Iterator[None]:
        """A selective forward's backward runs the forward again: where it did not run the same
        operations, the job's MODEL_ERROR says so, and what to open it with instead. A kept
        one's that reads what its forward changed in place (`KeptGraph.mark_changed`): the
        same."""
        try:
            yield
        except ChangedInPlace as exc:
            raise FlowmeshError(
                Code.MODEL_ERROR,
                f"job {self.name!r}: {self._where(task)}: {exc}, which plain PyTorch's "
                "backward refuses too (a variable needed for gradient computation modified by "
                "an inplace operation): change the model's in-place operation",
            ) from None
        except (CheckpointError, NotRepeated) as exc:
            if task.payload.get("policy") != SELECTIVE:
                raise
            why = str(exc).strip().splitlines()[0]
            raise FlowmeshError(
                Code.MODEL_ERROR,
                f"job {self.name!r}: {self._where(task)}: its forward did not repeat under the "
                f"selective activation policy ({why}); open the job with activations='keep' "
                "or 'recompute'",
            ) from None

    def _pause_hook(self, _: torch.Tensor) -> None:
        self.pause()

    def _stash(self, t: Any) -> Any:
        """Keep an activation (or a gradient) in the host tier between tasks (`Stash`). On
        CUDA the copy to the host is queued on the stash lane's stream after the compute so
        far, not waited for: the compute stream goes on, and whatever reads the stash orders
        itself after the copy (`_unstash`), unless more than STASH_IN_FLIGHT_BYTES are on
        their way. Where the device's resident room has space for it, it stays on the device
        instead (`gpu_worker.resident_room`), its bytes given back once the stash is dropped.
        On a CPU stand-in host memory is where it already is."""
        if not isinstance(t, torch.Tensor):
            return t
        # Its values only (the same storage and version counter): a tensor autograd saved may
        # carry the very node that saved it, a cycle through C++ that would keep the stash, and
        # its device memory, alive if the graph is dropped without a backward (a failed step).
        t = t.detach()
        if self._in_arena(t):
            # Arena bytes (a forward that returned a view of its parameters): they belong to
            # the extent's next owner as soon as this task's compute ran (on a GPU, perhaps
            # before the stash lane copied them); what the stash keeps is copied off them now.
            t = t.clone()
        room = self.device.resident_room
        if room is not None and t.device == self.device.torch_device:
            lease = room.lease(t)
            if lease is not None:
                return Stash(t, lease, resident=True)
        stash = Stash(*self.device.stash_out(t, TRAIN_STASH_LANE))
        if not stash.landed.done():
            self._stashing.append((stash.nbytes, stash.landed))
            self._stashing_bytes += stash.nbytes
        while self._stashing and (
            self._stashing_bytes > STASH_IN_FLIGHT_BYTES or self._stashing[0][1].done()
        ):
            nbytes, landed = self._stashing.popleft()
            landed.wait()  # asleep, on CUDA (a blocking event)
            self._stashing_bytes -= nbytes
        return stash

    def _in_arena(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.device.arena.untyped_storage().data_ptr()

    def _unstash(self, x: Any) -> Any:
        """A stash (or a step's data) on the device, for the compute stream: the copy the copy
        lane brought ahead (`prefetch`), after it landed; else one queued now on the compute
        stream, after the stash's copy to the host landed (from pinned memory the host does
        not wait). A step's data from pageable memory torch copies through a staging buffer
        first, as a blocking copy would."""
        if isinstance(x, Stash):
            if x.resident:
                # The stash itself, made on the compute stream and read on it, as on the CPU
                # stand-in: a forward that changed its input in place would change it too,
                # but its backward's recompute refuses that (in place on a leaf needing grad).
                return x.host
            brought = x.brought
            if brought is not None and brought[2] is self._admission:
                x.brought = None
                t, there, _ = brought
                there.order_current()
                return t
            x.landed.order_current()
            return x.host.to(self.device.torch_device, non_blocking=True)
        dev = self.device.torch_device
        if isinstance(x, torch.Tensor):
            return x.to(dev, non_blocking=True)
        if isinstance(x, Mapping):
            return {k: v.to(dev, non_blocking=True) for k, v in x.items()}
        return x

    def prefetch(
        self, task: Task, base: int, plan: CopyPlan, arena: torch.Tensor, after: list[Any]
    ) -> tuple[int, list[Any]]:
        """On the copy lane, once the task's own copies (`plan`, into its extent at `base`) are
        queued: start bringing back what the task will read from the host tier, when its copy
        to the host is in already (its input, its incoming gradient, what its kept or
        selective forward stashed, the last saved first), into the activation bytes its extent
        reserves, as far as they go; ordered after `after` where no copy of the plan was. What
        is not there yet, or does not fit, the task brings back itself when it reads it. The
        bytes started, and the markers of their copies: the task's compute orders itself after
        all of them (`TrainingExecutor`), so that whoever is given its extent next, ordered
        after that compute, never races a copy into it (one the task did not read)."""
        if task.kind not in (FORWARD, BACKWARD, LAST, EVAL):
            return 0, []
        key = (task.request, task.micro, task.sub)
        kept = self._kept.get(key)  # set once its forward ended: its stash is whole
        stashes = [self._grads.get(key)]
        if kept is not None:
            stashes.extend(kept[2].to_bring(self._unread[task.sub]))
        elif task.kind != BACKWARD or self._step_policy.get((task.request, task.sub)) == RECOMPUTE:
            # Its input (a kept graph's backward does not read it again; one whose forward has
            # not run yet may turn out to be one).
            stashes.append(self._acts.get(key))
        layout = self._layout(task)
        end = base + layout.total
        offset = end - aligned(layout.reserve, BLOCK_ALIGN)
        started, markers = 0, []
        for s in stashes:
            if not isinstance(s, Stash) or s.resident or not s.nbytes or not s.landed.done():
                continue
            size = aligned(s.nbytes, TENSOR_ALIGN)
            if offset + size > end:
                continue  # a smaller one after it may fit
            t, there = self.device.stash_in(
                s.host, s.landed, arena[offset : offset + size], after, TRAIN_LANE
            )
            s.brought = (t, there, plan)
            markers.append(there)
            after = []
            offset += size
            started += s.nbytes
        return started, markers

    def _input(self, task: Task) -> Any:
        key = (task.request, task.micro, task.sub)
        if task.sub == 0:
            return self._unstash(self._data[task.request][0][task.micro])
        return self._unstash(self._acts[key])

    def _buffers_write_back(self, sub: SubModel, arena: torch.Tensor, base: int) -> int:
        b0, b1 = sub.sections["B"]
        if b1 > b0:
            self._write_back(sub.slab[b0:b1], arena[base + b0 : base + b1])
        return b1 - b0

    def _run_forward(
        self,
        task: Task,
        sub: SubModel,
        base: int,
        arena: torch.Tensor,
        bound: list[TensorInfo],
    ) -> TaskResult:
        """A FORWARD task. Recompute policy: without grad, keeping what the recompute must
        replay (this forward's RNG state and the buffers it saw). Keep policy: with grad, its
        graph kept for the backward task, what autograd saves packed by `KeptGraph` (bound
        tensors by name, activations stashed). Selective policy: with grad under
        `torch.utils.checkpoint`, its products' outputs stashed (`SelectiveForward`), its
        buffers kept as the recompute policy keeps them (the backward computes the rest
        again, from its input, with the buffers this forward saw)."""
        key = (task.request, task.micro, task.sub)
        x = self._input(task)
        policy = self._policy_of(task)
        kept: KeptGraph | None = None
        selective: SelectiveForward | None = None
        graph = policy in (KEEP, SELECTIVE)  # the forward's graph kept for the backward task
        if graph and isinstance(x, torch.Tensor) and self._in_arena(x):
            # Brought back into this task's extent, which is another task's once this one ran;
            # the backward reads it (a selective forward's recompute starts from it).
            x = x.clone()
        if graph and task.sub > 0 and isinstance(x, torch.Tensor) and x.is_floating_point():
            x = x.detach().requires_grad_(True)
        if policy == KEEP:
            kept = KeptGraph({i.name: i.tensor for i in bound}, arena, self._stash, self._unstash)
        else:
            b0, b1 = sub.sections["B"]
            if b1 > b0:  # on CUDA the copy-in was only ordered after the last write-back
                self.wait_written((Region("B", sub.index),))
            snapshot = sub.slab[b0:b1].clone() if b1 > b0 else None
            self._replay[key] = (self.rng, snapshot)
        if policy == SELECTIVE:
            selective = SelectiveForward(self._stash, self._unstash)
        grad = torch.enable_grad() if graph else torch.no_grad()
        with _rng_scope(self.rng, self._cuda), grad, kept.hooks() if kept else nullcontext():
            with self._model_code(task):
                if selective is not None:
                    # The recompute in the backward task runs this again, under the same
                    # autocast, with the RNG state checkpoint saved here (its dropout masks).
                    out = checkpoint(
                        partial(self._computed_forward, sub),
                        x,
                        use_reentrant=False,
                        context_fn=selective.contexts,
                        preserve_rng_state=True,
                    )
                else:
                    with self._compute():
                        out = self._forward(sub, x)
            self.rng = _rng_get(self._cuda)
        if kept is not None:
            kept.mark_changed()
        if graph:
            self._saved[task.sub][policy] = (kept or selective).saved_bytes  # type: ignore[union-attr]
            self._kept[key] = (x, out, kept or selective)  # type: ignore[assignment]
        self._acts[(task.request, task.micro, task.sub + 1)] = self._stash(out.detach())
        return TaskResult(bytes_out=self._buffers_write_back(sub, arena, base))

    def _run_eval(self, task: Task, sub: SubModel) -> TaskResult:
        """A forward under no_grad with the sub-model in eval mode (dropout off, BatchNorm on its
        running statistics). Nothing it touches is written back, and the job's RNG state is
        restored, not advanced: later steps run as if it never happened."""
        key = (task.request, task.micro, task.sub)
        x = self._input(task)
        self._acts.pop(key, None)
        with _rng_scope(self.rng, self._cuda), torch.no_grad():
            for m in sub.modules:
                m.eval()
            try:
                with self._model_code(task), self._compute():
                    out = self._forward(sub, x)
            finally:
                for m in sub.modules:
                    m.train()
        if task.sub < self.parts - 1:
            self._acts[(task.request, task.micro, task.sub + 1)] = self._stash(out.detach())
            return TaskResult()
        target = self._unstash(self._data[task.request][1][task.micro])
        rows = self._eval_rows.get(task.request)
        with torch.no_grad(), self._compute():
            loss = self._loss(out, target)
            loss = loss / self.config.accumulate if rows is None else loss * (len(target) / rows)
        value = float(loss.item())
        self._losses[task.request].append(value)
        self._nonfinite[task.request] |= not math.isfinite(value)
        if not target.is_floating_point():  # class ids: the predictions' accuracy too
            classes = out.argmax(-1) if out.dim() == target.dim() + 1 else None
            if classes is not None:
                counts = self._correct[task.request]
                counts[0] += int((classes == target).sum())
                counts[1] += target.numel()
        return TaskResult(loss=value)

    def finish_eval(self, request: int) -> StepResult:
        """The evaluation's loss (the batch mean, as a step reports it) and metrics; the job's
        step count is the one it evaluated after."""
        losses = self._losses.pop(request, [])
        nonfinite = self._nonfinite.pop(request, False)
        right, counted = self._correct.pop(request, [0, 0])
        self._data.pop(request, None)
        self._eval_rows.pop(request, None)
        metrics: dict[str, float] = {"nonfinite": float(nonfinite)}
        if counted:
            metrics["accuracy"] = right / counted
        return StepResult(sum(losses), self.step_count, metrics)

    def abort_eval(self, request: int) -> None:
        """Forget a failed evaluation; it changed nothing, so the job stays usable."""
        for key in [k for k in self._acts if k[0] == request]:
            del self._acts[key]
        for store in (self._data, self._losses, self._nonfinite, self._correct, self._eval_rows):
            store.pop(request, None)  # type: ignore[attr-defined]

    def _where(self, task: Task) -> str:
        sub = self.subs[task.sub]
        if task.kind == EVAL:
            return (
                f"eval after step {self.step_count}, sub-model {sub.index} "
                f"(blocks {sub.start}..{sub.stop - 1})"
            )
        return (
            f"step {self.step_count + 1}, {task.kind} of sub-model {sub.index} "
            f"(blocks {sub.start}..{sub.stop - 1})"
        )

    def _run_backward(
        self, task: Task, sub: SubModel, base: int, arena: torch.Tensor
    ) -> TaskResult:
        key = (task.request, task.micro, task.sub)
        result = TaskResult()
        layout = self._layout(task)
        self._touched.clear()
        if task.kind == BACKWARD:
            self._policy_of(task)  # its forward's
        kept = self._kept.pop(key, None)
        store = None
        if kept is not None:
            x, out, store = kept  # its forward's graph: nothing to run again
        else:
            x = self._input(task)
            if task.sub > 0 and isinstance(x, torch.Tensor) and x.is_floating_point():
                x = x.detach().requires_grad_(True)
        rng = self.rng if task.kind == LAST else self._replay[key][0] if kept is None else None
        with _rng_scope(rng, self._cuda) if rng is not None else nullcontext(), torch.enable_grad():
            if kept is None:
                # The forward task's autocast state exactly, so the recompute gives its output;
                # the backward below runs outside it (`_compute`).
                with self._model_code(task), self._compute():
                    out = self._forward(sub, x)
            if task.kind == LAST:
                self.rng = _rng_get(self._cuda)
                result = self._loss_and_backward(task, out)
            else:
                incoming = self._unstash(self._grads.pop(key))
                if out.requires_grad:
                    with self._model_code(task), self._repeated(task):
                        torch.autograd.backward(out, incoming)
                if isinstance(store, SelectiveForward):
                    self._unread[task.sub] = store.unread()
        if task.sub > 0:
            if not isinstance(x, torch.Tensor) or x.grad is None:
                raise FlowmeshError(
                    Code.MODEL_ERROR,
                    f"job {self.name!r}: sub-model {task.sub}'s input got no gradient, so the "
                    "sub-models before it cannot learn; cut the model elsewhere",
                )
            self._grads[(task.request, task.micro, task.sub - 1)] = self._stash(x.grad)
        self._acts.pop(key, None)
        self._replay.pop(key, None)
        for info in self._fresh:
            grad = info.tensor.grad
            if grad is not None and grad.layout != torch.strided:
                # A sparse gradient (an Embedding(sparse=True)): dense, as a device's zeroed
                # view accumulates it, so that the stand-in trains as the device does.
                info.tensor.grad = grad.to_dense()
        if not task.payload["update"]:  # the gradients outlive the task: into their views
            for info in self._fresh:
                if info.tensor.grad is not None:
                    assert info.grad_slot is not None
                    view = self._view(arena, base + info.grad_slot.offset, info.grad_slot)
                    view.copy_(info.tensor.grad)
                    info.tensor.grad = view
        self._fresh = []
        now_valid = {
            n
            for n in sub.uses
            if self.tensors[n].trainable and (self.grad_valid[n] or n in self._touched)
        }
        last_micro = task.micro == self.config.accumulate - 1
        if last_micro and self.config.clip_grad_norm is not None:
            for n in sub.owned:
                info = self.tensors[n]
                if n in now_valid and info.tensor.grad is not None:
                    self._norms[n] = torch.linalg.vector_norm(info.tensor.grad, 2.0)
        if task.kind == LAST:
            result.bytes_out += self._buffers_write_back(sub, arena, base)
        if task.payload["update"]:
            self.pause()
            result.bytes_out += self._apply_update(task, sub, base, arena, now_valid, None)
            for n in sub.borrowed:
                result.bytes_out += self._grad_write_back(n, layout, base, arena, now_valid)
        else:
            g0, g1 = sub.sections["G"]
            if g1 > g0:
                self._write_back(sub.slab[g0:g1], arena[base + g0 : base + g1])
                result.bytes_out += g1 - g0
            for n in sub.owned:
                if self.tensors[n].trainable:
                    self.grad_valid[n] = n in now_valid
            for n in sub.borrowed:
                result.bytes_out += self._grad_write_back(n, layout, base, arena, now_valid)
        return result

    def _grad_write_back(
        self, n: str, layout: Layout, base: int, arena: torch.Tensor, now_valid: set[str]
    ) -> int:
        """A borrowed (tied) parameter's gradient goes back to its owner's gradient home."""
        info = self.tensors[n]
        off = layout.borrowed_grads.get(n)
        if off is None or info.grad_home is None or n not in now_valid:
            return 0
        self._write_back(info.grad_home, self._view(arena, base + off, info.slot))
        self.grad_valid[n] = True
        return info.slot.nbytes

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The job's loss on one micro-batch, checked to be a floating scalar tensor."""
        return checked_loss(self.loss_fn, self.config.loss, self.name, out, target)

    def _loss_and_backward(self, task: Task, out: torch.Tensor) -> TaskResult:
        target = self._unstash(self._data[task.request][1][task.micro])
        with self._compute():  # the loss in the forward's precision, its backward outside
            loss = self._loss(out, target) / self.config.accumulate
        value = float(loss.detach().item())
        nonfinite = not math.isfinite(value)
        if nonfinite and self.config.stop_on_nonfinite:
            raise FlowmeshError(
                Code.MODEL_ERROR,
                f"job {self.name!r}: the loss is {value} at step {self.step_count + 1} "
                f"(micro-batch {task.micro}); the step was not applied",
            )
        self._losses[task.request].append(value)
        self._nonfinite[task.request] |= nonfinite
        with self._model_code(task):
            loss.backward()
        return TaskResult(loss=value, nonfinite=nonfinite)

    def _run_update(self, task: Task, sub: SubModel, base: int, arena: torch.Tensor) -> TaskResult:
        total = self._total_norm.get(task.request)
        if total is None:
            norms = sorted(self._norms.items(), key=lambda kv: self.tensors[kv[0]].order)
            if norms:
                total = torch.linalg.vector_norm(torch.stack([v for _, v in norms]), 2.0)
            else:
                total = torch.zeros(())
            self._total_norm[task.request] = total
            self._norms = {}
        valid = {n for n in sub.owned if self.tensors[n].trainable and self.grad_valid[n]}
        return TaskResult(bytes_out=self._apply_update(task, sub, base, arena, valid, total))

    def _apply_update(
        self,
        task: Task,
        sub: SubModel,
        base: int,
        arena: torch.Tensor,
        valid: set[str],
        total_norm: torch.Tensor | None,
    ) -> int:
        """Step the sub-model's optimizer on its owned parameters and write them back."""
        opt = sub.optimizer
        self._updated.add(task.request)
        owned = [self.tensors[n] for n in sub.owned if self.tensors[n].trainable]
        for info in owned:
            if info.name not in valid:
                info.tensor.grad = None  # as after zero_grad(): the optimizer skips it
        if opt is not None and total_norm is not None:
            max_norm = self.config.clip_grad_norm
            assert max_norm is not None
            torch.nn.utils.clip_grads_with_norm_([i.tensor for i in owned], max_norm, total_norm)
        all_valid = bool(owned) and all(self.state_valid[i.name] for i in owned)
        adopted = [0]
        if opt is not None:
            try:
                if all_valid:
                    opt.step()
                else:  # a first update makes its state in parts, each moved home at once
                    step_adopting(opt, lambda: adopted.append(self._adopt_states(opt, owned)))
            except Exception as exc:
                raise _model_error(
                    self.name, f"the optimizer of sub-model {sub.index}", exc
                ) from None
        (p0, p1), (s0, s1) = sub.sections["P"], sub.sections["S"]
        written = sum(adopted)
        if p1 > p0:
            self._write_back(sub.slab[p0:p1], arena[base + p0 : base + p1])
            written += p1 - p0
        if all_valid and s1 > s0:
            self._write_back(sub.slab[s0:s1], arena[base + s0 : base + s1])
            written += s1 - s0
        for info in owned:
            self.grad_valid[info.name] = False
        return written

    def _adopt_states(self, opt: torch.optim.Optimizer, owned: list[TensorInfo]) -> int:
        """The state of an update that was some parameter's first, copied to its homes in the
        host tier and used there from now on (bound to the arena by the next updates): what the
        optimizer made, and the arena views of the others' (their S section is not written back
        as a whole then); the bytes copied."""
        written = 0
        for info in owned:
            state = opt.state.get(info.tensor)
            if not state:
                continue
            for key, home in info.state_homes.items():
                if key in state and state[key] is not home:
                    home.copy_(state[key])
                    state[key] = home
                    written += home.numel() * home.element_size()
            self.state_valid[info.name] = True
        return written

    # -- ending a step (driver thread, no task of the job running) ----------------------------

    def finish_step(self, request: int) -> StepResult:
        losses = self._losses.pop(request, [])
        nonfinite = self._nonfinite.pop(request, False)
        total = self._total_norm.pop(request, None)
        self._data.pop(request, None)
        self._updated.discard(request)
        self.step_count += 1
        self.last_loss = sum(losses)
        metrics: dict[str, float] = {"nonfinite": float(nonfinite)}
        if total is not None:
            metrics["grad_norm"] = float(total)
        policies = [
            self._step_policy.pop((request, i), self.activation_policy(i))
            for i in range(self.parts - 1)
        ]
        return StepResult(sum(losses), self.step_count, metrics, [*policies, NO_POLICY])

    def drop_steps(self) -> None:
        """The job is closed: what its steps and evaluations kept goes, the graphs its kept
        forwards left for backwards that will never run too (they hold the job through their
        hooks as it holds them: a cycle through autograd's C++ that the garbage collector
        cannot see), and with them their stashes' memory. Run after the job's last compute."""
        for store in (
            self._acts,
            self._grads,
            self._replay,
            self._kept,
            self._step_policy,
            self._data,
            self._losses,
            self._nonfinite,
            self._total_norm,
            self._correct,
            self._eval_rows,
            self._norms,
            self._updated,
        ):
            store.clear()

    def abort_step(self, request: int, reason: str) -> None:
        """Forget a failed step: its kept activations and partial gradients go; if an update
        of it was already applied, the job is inconsistent and refuses further steps."""
        for store in (self._acts, self._grads, self._replay, self._kept, self._step_policy):
            for key in [k for k in store if k[0] == request]:
                del store[key]
        self._data.pop(request, None)
        self._losses.pop(request, None)
        self._nonfinite.pop(request, None)
        self._total_norm.pop(request, None)
        self._norms = {}
        for n in self.grad_valid:
            self.grad_valid[n] = False
        if request in self._updated:
            self._updated.discard(request)
            self.broken = (
                f"step {self.step_count + 1} failed after part of it was applied: {reason}"
            )
