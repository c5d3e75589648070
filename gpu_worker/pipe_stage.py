"""One stage of a training job cut into pipeline stages over several workers (issue 23 §2).

The model's chain is cut into contiguous block ranges, one per stage; a stage holds its blocks
on its worker's device with a torch optimizer over the parameters it owns, and computes, per
micro-batch of a step (the step's `accumulate` micro-batches: the pipeline's):

    forward(m, x, rng)          -> (y, rng')         y goes on to the next stage
    last(m, x, target, rng)     -> (loss, dx, rng')  the last stage: loss / M, its backward
    backward(m, dy)             -> dx                dx goes back to the previous stage

then, once every micro-batch's backward has run, `norms` (what a global gradient clip needs
from this stage) and `update` (clip with the global norm, step, zero the gradients). The
driver that moves activations and gradients between stages is not here: this is plain torch
on one device, driven in process by the tests and by the worker's shell alike.

What keeps it exact against plain PyTorch (`flowmesh.reference.train`, the same rule as the
memory-flow job, `gpu_worker.train_job`):

- randomness: the job's RNG state travels with the activation. A stage's forward starts from
  the state the previous stage's forward left (stage 0: the one the last stage left after the
  previous micro-batch, or the job's at the first), so dropout draws what it would in one
  process running the micro-batches one after the other.
- tied weights: a parameter used by two stages (GPT-2's embedding and its LM head) is owned by
  the first that uses it; a later stage holds a copy (`borrowed`), sends its gradient to the
  owner before the update, one per micro-batch (`tied_grads` / `add_tied_grads`), and takes the
  owner's updated value after it (`tied_values` / `set_tied_values`). The owner sums them as
  one process does (`settle_tied`: per micro-batch both uses, then the micro-batches in order),
  so that even Adam on a gradient of float noise takes the same step.
- clipping: the owner of each parameter gives its gradient's norm with the parameter's place
  in the model (`norms`); the driver stacks them all in that order and takes the norm, as
  `clip_grad_norm_` does, and every stage clips with that total.
- parameters that get no gradient keep `grad=None`, and the optimizer skips them, as after
  `zero_grad()`.
- buffers: each forward updates a fresh copy of the stage's buffers (`_fresh_buffers`), so a
  micro-batch's backward, run after later micro-batches' forwards, sees them as its own forward
  did; BatchNorm's statistics move once per forward, in micro-batch order.
- mixed precision (`compute_dtype` "bfloat16"): forward and loss under one `torch.autocast`,
  the backward and the update outside it, as a PyTorch AMP loop does.

On a worker the stage lives in its device's arena (`place`): its parameters, and its optimizer's
state from the first update on (or from a checkpoint), are views of a range held for the job's
life (`TrainingExecutor.hold`), so that what the worker holds stays within the arena, beside the
memory-flow jobs and served models it shares it with. The first update makes the optimizer's
state in parts, each moved in before the next is made (`flowmesh.optimizers.step_adopting`).
Gradients and activations, made per step by autograd, are beside it, as a memory-flow task's
activations are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from flowmesh.errors import Code, FlowmeshError, bad_request
from flowmesh.modelio.build import build_reference
from flowmesh.modelio.chain import Block, chain_of
from flowmesh.modelio.dtypes import TORCH_DTYPES
from flowmesh.modelio.inputs import call_model, declared_inputs, make_inputs
from flowmesh.modelio.planners import even_cut
from flowmesh.optimizers import state_count, state_slots, step_adopting
from flowmesh.spec import ModelSpec
from gpu_worker.host_tier import Slot, view_of
from gpu_worker.model_code import building_model
from gpu_worker.train_config import TrainConfig, checked_loss, make_optimizer, resolve_loss
from gpu_worker.train_job import RngState, _as_output, _model_error, _rng_get, _rng_scope
from gpu_worker.train_layout import SlotPacker, TensorInfo, check_ranges, collect

Inputs = torch.Tensor | Mapping[str, torch.Tensor]


def job_rng(seed: int, cuda: int | None = None) -> RngState:
    """A job's RNG state before its first step: torch's generators seeded with `seed`."""
    cuda_state = None
    if cuda is not None:
        cuda_state = torch.Generator(device=f"cuda:{cuda}").manual_seed(seed).get_state()
    return torch.Generator().manual_seed(seed).get_state(), cuda_state


def total_norm(norms: Iterable[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The global gradient norm from every stage's `norms`, stacked in the model's order (as
    `clip_grad_norm_` stacks per-parameter norms)."""
    ordered = [n for _, n in sorted(norms, key=lambda item: item[0])]
    if not ordered:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.to("cpu") for n in ordered]), 2.0)


class PipeStage:
    """Stage `stage` of the chain `blocks` cut at `ranges`, on `device`.

    Built from the whole chain (every stage's worker builds the same seeded model and keeps
    its own blocks), so that ownership of shared tensors and the parameters' order in the model
    are the same on every stage."""

    def __init__(
        self,
        job: str,
        blocks: Sequence[Block],
        ranges: Sequence[tuple[int, int]],
        stage: int,
        config: TrainConfig,
        device: torch.device | str = "cpu",
        *,
        allow: Iterable[str] | None = None,
        place_later: bool = False,
    ) -> None:
        """`place_later`: its tensors stay where the blocks were built (the host) until `place`
        puts them on `device`, in its arena: never a whole copy of them on the device beside
        it."""
        self.job = job
        self.config = config
        self.ranges = [(int(a), int(b)) for a, b in ranges]
        check_ranges(self.ranges, len(blocks))
        if not 0 <= stage < len(self.ranges):
            raise bad_request(f"stage {stage} of {len(self.ranges)}")
        self.stage = stage
        self.first = stage == 0
        self.is_last = stage == len(self.ranges) - 1
        self.device = torch.device(device)
        self.loss_fn = resolve_loss(config.loss, allow) if self.is_last else None
        self._autocast: torch.dtype | None = (
            None if config.compute_dtype == "float32" else TORCH_DTYPES[config.compute_dtype]
        )
        self._cuda = self.device.index if self.device.type == "cuda" else None
        if self.device.type == "cuda" and self._cuda is None:
            self._cuda = torch.cuda.current_device()
        tensors, subs = collect(blocks, self.ranges)
        sub = subs[stage]
        self.modules = list(sub.modules)
        for m in self.modules:
            if not place_later:
                m.to(self.device)
            m.train()
        self.tensors: dict[str, TensorInfo] = {n: tensors[n] for n in sub.uses}
        self.owned = [tensors[n] for n in sub.owned if tensors[n].trainable]
        self.borrowed = [tensors[n] for n in sub.borrowed if tensors[n].trainable]
        # This stage's parameters that later stages borrow, by name: their gradients come in
        # before the update, their values go out after it; by borrowing stage, and the stages
        # this one borrows from.
        self.lent = sorted(
            {n for s in subs[stage + 1 :] for n in s.borrowed if tensors[n].owner == stage}
        )
        self.borrowers: dict[int, list[str]] = {}
        for s in subs[stage + 1 :]:
            names = [n for n in s.borrowed if tensors[n].owner == stage and tensors[n].trainable]
            if names:
                self.borrowers[s.index] = names
        self.owners: dict[int, list[str]] = {}
        for info in (tensors[n] for n in sub.borrowed if tensors[n].trainable):
            self.owners.setdefault(info.owner, []).append(info.name)
        params = [i.tensor for i in self.owned]
        self.optimizer = make_optimizer(config.optimizer, params, allow) if params else None
        for info in self.tensors.values():
            if info.is_param:
                info.tensor.grad = None
        # Per micro-batch of the step under way: the input (a leaf that collects its gradient)
        # and the output whose graph the backward runs.
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        # A tied weight's gradient per micro-batch: this stage's (lent or borrowed), and the
        # borrowers' (lent ones), summed in one process's order by `settle_tied`.
        self._tied = [*self.lent, *(i.name for i in self.borrowed)]
        self._tied_own: dict[str, dict[int, torch.Tensor]] = {}
        self._tied_in: dict[str, dict[int, list[torch.Tensor]]] = {}
        self.losses: list[float] = []
        self.nonfinite = False
        self._footprint: int | None = None  # `footprint`
        # Where it lives in the arena once `place`d: each parameter's slot, and each owned one's
        # optimizer state slots (by state key), from the start of its range.
        self._slots: dict[str, Slot] = {}
        self._state_slots: dict[str, dict[str, Slot]] = {}
        self._arena: torch.Tensor | None = None
        self._base = 0
        # The most micro-batches whose forward graph this stage held at once in the step under
        # way (their activations: what the pipeline's schedule bounds); reset by `_zero`.
        self.held_peak = 0

    # -- per micro-batch ---------------------------------------------------------------------

    def _compute(self) -> AbstractContextManager[Any]:
        if self._autocast is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self._autocast)

    def _take(self, x: Any) -> Any:
        """The micro-batch's input on this device; after stage 0, a leaf whose gradient is what
        goes back to the previous stage."""
        if isinstance(x, Mapping):
            return {k: v.to(self.device) for k, v in x.items()}
        x = x.to(self.device)
        if not self.first:
            if not x.is_floating_point():
                raise FlowmeshError(
                    Code.PLAN_ERROR,
                    f"job {self.job!r}: stage {self.stage} receives a {x.dtype} tensor; a "
                    "pipeline can only be cut where a floating activation passes",
                )
            x = x.detach().requires_grad_(True)
        return x

    def _fresh_buffers(self) -> None:
        """Every buffer replaced by a copy before a forward: what the forward updates in place
        (BatchNorm's statistics, a running scale) is the copy, and what an earlier micro-batch's
        graph saved stays as that forward saw it, though its backward runs after this one."""
        fresh: dict[int, torch.Tensor] = {}
        for module in self.modules:
            for sub in module.modules():
                for name, buf in sub._buffers.items():
                    if buf is not None:
                        sub._buffers[name] = fresh.setdefault(id(buf), buf.clone())
        for info in self.tensors.values():
            if not info.is_param and id(info.tensor) in fresh:
                info.tensor = fresh[id(info.tensor)]

    def _run(self, x: Any, rng: RngState, fresh: bool = True) -> tuple[torch.Tensor, RngState]:
        if fresh:
            self._fresh_buffers()
        with _rng_scope(rng, self._cuda), self._compute():
            out: Any = x
            try:
                for j, module in enumerate(self.modules):
                    out = call_model(module, out) if self.first and j == 0 else module(out)
                out = _as_output(out)
            except FlowmeshError:
                raise
            except Exception as exc:
                raise _model_error(self.job, f"stage {self.stage}'s forward", exc) from None
            return out, _rng_get(self._cuda)

    def forward(self, micro: int, x: Any, rng: RngState) -> tuple[torch.Tensor, RngState]:
        """Micro-batch `micro` through this (not last) stage: its output, detached (what the
        next stage receives), and the RNG state after it."""
        x = self._take(x)
        out, rng = self._run(x, rng)
        self._graphs[micro] = (x, out)
        self.held_peak = max(self.held_peak, len(self._graphs))
        return out.detach(), rng

    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The job's loss on a micro-batch, under the forward's autocast, checked scalar."""
        assert self.loss_fn is not None
        with self._compute():
            return checked_loss(
                self.loss_fn, self.config.loss, self.job, out, target, said="the loss"
            )

    def evaluate(self, x: Any, rng: RngState) -> torch.Tensor:
        """A micro-batch of an evaluation through this stage: no grad, the modules in eval mode
        (dropout off, BatchNorm on its running statistics), nothing written, the job's RNG
        state left as it was."""
        if isinstance(x, Mapping):
            x = {k: v.to(self.device) for k, v in x.items()}
        else:
            x = x.to(self.device)
        try:
            for m in self.modules:
                m.eval()
            with torch.no_grad():
                out, _ = self._run(x, rng, fresh=False)
        finally:
            for m in self.modules:
                m.train()
        return out

    def eval_loss(
        self, out: torch.Tensor, target: torch.Tensor, weight: float
    ) -> tuple[float, int, int]:
        """The last stage's loss of an evaluation's micro-batch, times `weight` (its share of
        the batch's rows), and (right, counted) predictions for class targets."""
        target = target.to(self.device)
        with torch.no_grad():
            value = float(self._loss(out, target).item()) * weight
        right = counted = 0
        if not target.is_floating_point() and out.dim() == target.dim() + 1:
            right, counted = int((out.argmax(-1) == target).sum()), target.numel()
        return value, right, counted

    def last(
        self, micro: int, x: Any, target: torch.Tensor, rng: RngState
    ) -> tuple[float, torch.Tensor | None, RngState]:
        """Micro-batch `micro` through the last stage: forward, loss / M, backward. Returns the
        loss, the gradient of its input (None on a one-stage pipeline) and the RNG state."""
        x = self._take(x)
        out, rng = self._run(x, rng)
        loss = self._loss(out, target.to(self.device)) / self.config.accumulate
        value = float(loss.detach().item())
        if not math.isfinite(value):
            self.nonfinite = True
            if self.config.stop_on_nonfinite:
                raise FlowmeshError(
                    Code.MODEL_ERROR,
                    f"job {self.job!r}: the loss is {value} (micro-batch {micro}); the step "
                    "was not applied",
                )
        self.losses.append(value)
        self._backward(micro, loss.backward)
        return value, self._input_grad(x), rng

    def backward(self, micro: int, grad: torch.Tensor) -> torch.Tensor | None:
        """The backward of micro-batch `micro` with the gradient of this stage's output; the
        gradient of its input (None on stage 0)."""
        x, out = self._graphs.pop(micro)
        self._backward(micro, lambda: out.backward(grad.to(device=self.device, dtype=out.dtype)))
        return self._input_grad(x)

    def _backward(self, micro: int, run: Any) -> None:
        """Run a micro-batch's backward; a tied weight's gradient of it is kept apart, by
        micro-batch, for `settle_tied`."""
        tied = [self.tensors[n].tensor for n in self._tied]
        for t in tied:
            t.grad = None
        try:
            run()
        except Exception as exc:
            raise _model_error(self.job, f"stage {self.stage}'s backward", exc) from None
        finally:
            for name, t in zip(self._tied, tied, strict=True):
                if t.grad is not None:
                    self._tied_own.setdefault(name, {})[micro] = t.grad
                t.grad = None

    def _input_grad(self, x: Any) -> torch.Tensor | None:
        if self.first or not isinstance(x, torch.Tensor):
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)

    # -- ending the step ---------------------------------------------------------------------

    def tied_grads(self) -> dict[str, torch.Tensor]:
        """The gradients of the parameters this stage borrows, per micro-batch, for their
        owners ("name@m"; only the owner updates)."""
        out = {}
        for info in self.borrowed:
            for m, grad in self._tied_own.pop(info.name, {}).items():
                out[f"{info.name}@{m}"] = grad
        return out

    def add_tied_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Another stage's gradients of parameters lent by this one ("name@m"), kept until
        `settle_tied`."""
        for key, grad in grads.items():
            name, _, m = key.rpartition("@")
            if name not in self.lent or not m.isdigit():
                raise bad_request(f"stage {self.stage} lends no parameter {key!r}")
            t = self.tensors[name].tensor
            self._tied_in.setdefault(name, {}).setdefault(int(m), []).append(
                grad.to(device=self.device, dtype=t.dtype)
            )

    def settle_tied(self) -> None:
        """Each lent weight's gradient, summed as one process sums it: per micro-batch, this
        stage's use and the others', then the micro-batches in order."""
        for name in self.lent:
            own, others = self._tied_own.pop(name, {}), self._tied_in.pop(name, {})
            total: torch.Tensor | None = None
            for m in sorted(set(own) | set(others)):
                parts = ([own[m]] if m in own else []) + others.get(m, [])
                step = parts[0]
                for g in parts[1:]:
                    step = step + g
                total = step if total is None else total + step
            self.tensors[name].tensor.grad = total

    def norms(self) -> list[tuple[int, torch.Tensor]]:
        """The norm of every owned parameter's gradient, with its place in the model."""
        return [
            (info.order, torch.linalg.vector_norm(info.tensor.grad.detach(), 2.0))
            for info in self.owned
            if info.tensor.grad is not None
        ]

    def update(self, total: torch.Tensor | None) -> float:
        """Clip with the global norm `total` (when the job clips), step the optimizer, zero the
        gradients; the step's loss on the last stage (0 elsewhere)."""
        if self._graphs:
            raise bad_request(
                f"job {self.job!r}: stage {self.stage} updated with the backward of "
                f"micro-batches {sorted(self._graphs)} not run"
            )
        params = [i.tensor for i in self.owned]
        if self.optimizer is not None:
            if self.config.clip_grad_norm is not None and total is not None:
                torch.nn.utils.clip_grads_with_norm_(
                    params, self.config.clip_grad_norm, total.to(self.device)
                )
            adopted: list[bool] = []
            try:
                if self._arena is None:  # its state lives where the optimizer makes it
                    self.optimizer.step()
                else:  # a first update makes its state in parts, each moved in at once
                    step_adopting(self.optimizer, lambda: adopted.append(self._adopt_states()))
            except Exception as exc:
                raise _model_error(self.job, f"stage {self.stage}'s optimizer", exc) from None
            if any(adopted):
                self._give_back_cache()
        self._zero()
        loss, self.losses = sum(self.losses), []
        self.nonfinite = False
        return loss

    def abort(self) -> None:
        """Drop what a failed step left: graphs, gradients, losses; the weights are untouched
        unless `update` ran."""
        self._graphs.clear()
        self._zero()
        self.losses, self.nonfinite = [], False

    def _zero(self) -> None:
        for info in self.tensors.values():
            if info.is_param:
                info.tensor.grad = None
        self._tied_own.clear()
        self._tied_in.clear()
        self.held_peak = 0

    def tied_values(self) -> dict[str, torch.Tensor]:
        """The values of the parameters this stage lends, after its update (copies: they
        travel after this call returns, and a placed stage's range goes back at close)."""
        return {n: self.tensors[n].tensor.detach().clone() for n in self.lent}

    def set_tied_values(self, values: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for info in self.borrowed:
                if info.name in values:
                    info.tensor.copy_(values[info.name])

    def footprint(self, allow: Iterable[str]) -> int:
        """The device bytes it holds: its tensors, and its trainable ones' gradients and
        optimizer state (counted once: the optimizer's state is probed on a small tensor)."""
        if self._footprint is None:
            held = {id(i.tensor): i.tensor for i in self.tensors.values()}
            nbytes = sum(t.numel() * t.element_size() for t in held.values())
            trainable = sum(i.tensor.numel() * i.tensor.element_size() for i in self.owned)
            states = state_count(self.config.optimizer, tuple(allow))
            self._footprint = nbytes + trainable * (1 + states)
        return self._footprint

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors this stage owns, by their names in the model's state_dict (copies: on a
        CPU worker its parameters are views of the arena, whose range goes back at close)."""
        return {
            n: i.tensor.detach().to("cpu", copy=True)
            for n, i in self.tensors.items()
            if i.owner == self.stage
        }

    # -- in the arena ------------------------------------------------------------------------

    def lay_out(self, allow: Iterable[str]) -> int:
        """Lay out the range `place` puts it in: every parameter it holds (its own, and its
        copies of borrowed ones), then its own trainable ones' optimizer state (the state keys
        shaped like their parameter, `flowmesh.optimizers.state_slots`; an optimizer with other
        state keeps it beside the arena). Returns the range's bytes."""
        pack = SlotPacker()
        self._slots = {n: pack.place(n, i.tensor) for n, i in self.tensors.items() if i.is_param}
        try:
            kinds = state_slots(self.config.optimizer, [i.tensor for i in self.owned], allow)
        except FlowmeshError:
            kinds = [{} for _ in self.owned]
        self._state_slots = {}
        for info, keys in zip(self.owned, kinds, strict=True):
            self._state_slots[info.name] = {
                key: pack.state(info, key, dtype) for key, dtype in keys.items()
            }
        return pack.offset

    def place(self, arena: torch.Tensor, base: int) -> None:
        """Move its parameters, and whatever optimizer state there is, into `arena` at `base`
        (`lay_out`'s range): each Parameter object stays the same, its data now a view there."""
        if arena.device != self.device:
            raise FlowmeshError(
                Code.INTERNAL, f"stage on {self.device} placed in an arena on {arena.device}"
            )
        self._arena, self._base = arena, base
        with torch.no_grad():
            for name, slot in self._slots.items():
                t = self.tensors[name].tensor
                view = view_of(arena, base + slot.offset, slot)
                view.copy_(t.detach())
                t.data = view
            # Buffers (a stage built to be placed has them where it was built) go to the
            # device as they are: each forward replaces them with fresh copies anyway.
            moved: dict[int, torch.Tensor] = {}
            for module in self.modules:
                for sub in module.modules():
                    for key, buf in sub._buffers.items():
                        if buf is not None and buf.device != self.device:
                            sub._buffers[key] = moved.setdefault(id(buf), buf.to(self.device))
            for info in self.tensors.values():
                if not info.is_param and id(info.tensor) in moved:
                    info.tensor = moved[id(info.tensor)]
        if self._adopt_states():
            self._give_back_cache()
        if self.optimizer is not None:  # state the arena does not take goes to the device
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() and (
                        value.device != self.device
                    ):
                        state[key] = value.to(self.device)

    def _adopt_states(self) -> bool:
        """The optimizer's state tensors made since the last time (its first update, or a
        checkpoint's) copied into their slots and used there from now on; whether there were
        any."""
        arena, opt = self._arena, self.optimizer
        if arena is None or opt is None:
            return False
        adopted = False
        with torch.no_grad():
            for info in self.owned:
                state = opt.state.get(info.tensor)
                if not state:
                    continue
                for key, slot in self._state_slots.get(info.name, {}).items():
                    value = state.get(key)
                    if not isinstance(value, torch.Tensor) or value.data_ptr() == (
                        arena.data_ptr() + self._base + slot.offset
                    ):
                        continue
                    view = view_of(arena, self._base + slot.offset, slot)
                    view.copy_(value)
                    state[key] = view
                    adopted = True
        return adopted

    def _give_back_cache(self) -> None:
        """What the optimizer made beside the arena, adopted since, goes back to the device,
        not to torch's cache (once, at the first update or a checkpoint's load)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def in_arena(self) -> list[torch.Tensor]:
        """The tensors it keeps in the arena now (its parameters, its optimizer state there)."""
        out = [self.tensors[n].tensor for n in self._slots]
        if self.optimizer is not None:
            for info in self.owned:
                state = self.optimizer.state.get(info.tensor, {})
                out += [state[k] for k in self._state_slots.get(info.name, {}) if k in state]
        return out


def cut_even(blocks: Sequence[Block], stages: int) -> list[tuple[int, int]]:
    """The chain cut into `stages` contiguous ranges of about even parameter and buffer bytes
    (every stage's worker computes the same cut from the same chain, and the broker plans
    with it: `planners.even_cut`); each range holds at least one block."""
    sizes = []
    for block in blocks:
        seen = {id(t): t for t in block.module.state_dict(keep_vars=True).values()}
        sizes.append(sum(t.numel() * t.element_size() for t in seen.values()))
    try:
        return even_cut(sizes, stages)
    except FlowmeshError as exc:
        raise bad_request(exc.reason) from None


def build_stage(
    job: str,
    spec: ModelSpec,
    config: TrainConfig,
    stage: int,
    stages: int,
    device: torch.device | str,
    allow: Iterable[str],
    place_later: bool = False,
) -> PipeStage:
    """Stage `stage` of `spec` cut into `stages`: the model built as deployed (its weights
    file or directory, or its seed), its chain cut by `cut_even` (`place_later`: see
    `PipeStage`)."""
    allow = tuple(allow)
    with building_model():
        model = build_reference(spec, allow)  # in eval mode: tracing it moves no statistic
        inputs = declared_inputs(spec, model)
        blocks = chain_of(model, make_inputs(inputs, 1, 1, "cpu") if inputs is not None else None)
    return PipeStage(
        job, blocks, cut_even(blocks, stages), stage, config, device, allow=allow,
        place_later=place_later,
    )  # fmt: skip


def step_in_process(
    stages: Sequence[PipeStage],
    inputs: Inputs,
    targets: torch.Tensor,
    rng: RngState,
) -> tuple[float, RngState, torch.Tensor | None]:
    """One step of `stages` run in this process, in GPipe order (every micro-batch's forward,
    then every backward, last first): the step's loss, the job's RNG state after it and the
    global gradient norm (None without clipping). What the workers do over sockets, in one
    place: the reference the in-process tests hold the stages to."""
    accumulate = stages[0].config.accumulate
    xs = micro_batches(inputs, accumulate)
    ys = targets.chunk(accumulate) if accumulate > 1 else [targets]
    grads: list[torch.Tensor | None] = []
    for m, (x, y) in enumerate(zip(xs, ys, strict=True)):
        act: Any = x
        for stage in stages[:-1]:
            act, rng = stage.forward(m, act, rng)
        _, grad, rng = stages[-1].last(m, act, y, rng)
        grads.append(grad)
    for m in reversed(range(accumulate)):
        grad = grads[m]
        for stage in reversed(stages[:-1]):
            assert grad is not None
            grad = stage.backward(m, grad)
    for k, stage in enumerate(stages):
        tied = stage.tied_grads()
        for owner in stages[:k]:
            owner.add_tied_grads(
                {n: g for n, g in tied.items() if n.rpartition("@")[0] in owner.lent}
            )
    for stage in stages:
        stage.settle_tied()
    total = None
    if stages[0].config.clip_grad_norm is not None:
        total = total_norm(n for s in stages for n in s.norms())
    loss = sum(s.update(total) for s in stages)
    for k, stage in enumerate(stages):
        for later in stages[k + 1 :]:
            later.set_tied_values(stage.tied_values())
    return loss, rng, total


def split_rows(inputs: Inputs, rows: int) -> list[Inputs]:
    """`inputs` in pieces of `rows` rows (the last may have fewer)."""
    if isinstance(inputs, torch.Tensor):
        return list(inputs.split(rows))
    parts = {k: v.split(rows) for k, v in inputs.items()}
    return [{k: parts[k][i] for k in inputs} for i in range(len(next(iter(parts.values()))))]


def micro_batches(inputs: Inputs, n: int) -> list[Inputs]:
    """`inputs` in `n` micro-batches (`chunk`, as the reference loop cuts them)."""
    if n == 1:
        return [inputs]
    if isinstance(inputs, torch.Tensor):
        return list(inputs.chunk(n))
    parts = {k: v.chunk(n) for k, v in inputs.items()}
    return [{k: parts[k][i] for k in inputs} for i in range(n)]
