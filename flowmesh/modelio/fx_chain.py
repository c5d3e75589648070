"""A chain read from a torch.fx trace, for models whose forward is not a plain nn.Sequential.

The forward is traced with the model's direct children as leaves (children of plain Sequential,
ModuleList and ModuleDict containers count as direct: containers are never called themselves), so
the graph shows which child runs when and what flows between them, without tracing inside them.

The graph is then cut where exactly one tensor value is live, i.e. where everything the rest of
the forward needs is one tensor. Each block ends at the first such cut after a child call, so the
glue that follows a child (`torch.flatten` between pool and fc) goes into the next child's block
and a child called on the previous output with nothing else is kept as the block itself. Where
a skip connection spans several children, the cut moves past them and one block holds them all.
"""

from __future__ import annotations

import builtins
import itertools
import operator
import threading
from typing import Any

import torch
from torch import fx, nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.inputs import declared_inputs, example_inputs
from flowmesh.modelio.sequential import is_plain_sequential
from flowmesh.spec import ModelSpec

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_HOW_TO = (
    "expose the model as an nn.Sequential of blocks that each take and return one tensor, or "
    "register an adapter with flowmesh.modelio.chain.register_adapter"
)


def _not_a_chain(model: nn.Module, why: str) -> FlowmeshError:
    return FlowmeshError(Code.NOT_A_CHAIN, f"{type(model).__name__}: {why}; {_HOW_TO}")


def leaf_names(model: nn.Module) -> set[str]:
    """Qualified names of the modules treated as leaves: direct children, looking through
    containers."""
    out: set[str] = set()

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}{name}"
            if is_plain_sequential(child) or isinstance(child, _CONTAINERS):
                visit(child, qual + ".")
            else:
                out.add(qual)

    visit(model, "")
    return out


# While it traces, torch.fx patches nn.Module.__call__ and __getattr__ for the whole process
# and keeps its patcher in a global. So these traces are taken one at a time, and a module that
# another thread calls meanwhile (a serving run on a compute lane, another plan's shape
# propagation) is called and reads its parameters as usual, not through the tracer (which
# refused it: "module is not installed as a submodule", or handed it a Proxy). What this cannot
# reach: fx's global "tracing" flag, which torch.compile'd code on another thread would see
# (flowmesh compiles nothing), and fx tracers other than this one. Not re-entrant: a forward
# that reads a chain itself would wait forever.
_ONE_TRACE = threading.Lock()


class _LeafTracer(fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves
        self._thread: int | None = None

    def trace(self, root: Any, concrete_args: Any = None) -> fx.Graph:
        with _ONE_TRACE:
            self._thread = threading.get_ident()
            try:
                return super().trace(root, concrete_args)
            finally:
                self._thread = None

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(
            m, module_qualified_name
        )


def _example(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Batch-1 inputs from the model's `flowmesh_inputs`, on the model's device."""
    declared = declared_inputs(ModelSpec(name="x", factory="a:b"), model)
    if declared is None:
        return None
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = first.device if first is not None else torch.device("cpu")
    return example_inputs(declared, batch=1, device=device)


def _tensor_kinds(
    model: nn.Module, gm: fx.GraphModule, example: dict[str, torch.Tensor]
) -> dict[fx.Node, bool]:
    """Which nodes produce a tensor, by running the traced graph once (on meta: no compute)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = []
    for i, ph in enumerate(placeholders):
        if ph.target in example:
            args.append(example[ph.target])
        elif i == 0 and len(example) == 1:
            args.append(next(iter(example.values())))
        elif ph.args:
            args.append(ph.args[0])  # the placeholder's default value
        else:
            raise _not_a_chain(model, f"its forward argument {ph.target!r} is not a declared input")
    kinds: dict[fx.Node, bool] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node):
            result = super().run_node(n)
            kinds[n] = isinstance(result, torch.Tensor)
            return result

    try:
        with torch.no_grad():
            Recorder(gm).run(*args)
    except FlowmeshError:
        raise
    except Exception as exc:
        raise _not_a_chain(
            model, f"running its traced forward on the declared inputs failed: {exc}"
        ) from None
    return kinds


# Methods and functions whose result is a tuple, a list or a Python value, never one tensor.
_NOT_TENSOR_RESULTS = frozenset(
    {
        "chunk", "split", "split_with_sizes", "tensor_split", "unbind", "hsplit", "vsplit",
        "dsplit", "unsafe_chunk", "unsafe_split", "size", "dim", "numel", "tolist", "item",
        "topk", "sort", "kthvalue", "mode", "aminmax", "frexp", "slogdet", "qr", "svd",
        "meshgrid", "broadcast_tensors", "unique_consecutive", "lstsq",
    }
)  # fmt: skip
_NOT_TENSOR_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad"})


def _may_not_be_tensor(model: nn.Module, node: fx.Node) -> bool:
    """Without an example to run, whether `node`'s value is possibly not one tensor: a value
    only unpacked (`p, q = child(x)`, `out[0]`), a call known to give a tuple or a Python value,
    or a child of a kind that returns a tuple. Cutting there would hand a tuple between stages."""
    users = list(node.users)
    if users and all(
        u.op == "call_function" and u.target in (operator.getitem, builtins.getattr) for u in users
    ):
        return True
    target = node.target
    if node.op == "call_method" and target in _NOT_TENSOR_RESULTS:
        return True
    if node.op == "call_function":
        if target is builtins.getattr:
            return len(node.args) > 1 and node.args[1] in _NOT_TENSOR_ATTRS
        if getattr(target, "__name__", None) in _NOT_TENSOR_RESULTS:
            return True
        return target in (builtins.len, builtins.tuple, builtins.list, builtins.dict)
    if node.op == "call_module":
        child = model.get_submodule(str(target))
        if isinstance(child, (nn.RNNBase, nn.MultiheadAttention)):
            return True
        return bool(getattr(child, "return_indices", False))  # max pooling with indices
    return False


def _cuts(model: nn.Module, order: list[fx.Node], kinds: dict[fx.Node, bool] | None) -> list[int]:
    """Positions k (cut after order[k]) where blocks end: the first point after a child call
    where one tensor is the only live value (and another child call follows)."""
    pos = {n: i for i, n in enumerate(order)}
    end = len(order)

    def last_use(v: fx.Node) -> int:
        return max((pos.get(u, end) for u in v.users), default=pos.get(v, -1))

    live: set[fx.Node] = {
        n for n in order[0].graph.nodes if n.op == "placeholder" and last_use(n) >= 0
    }
    dying: dict[int, list[fx.Node]] = {}
    for v in live:
        dying.setdefault(last_use(v), []).append(v)
    heavy_after = [False] * end  # is there a child call after position k?
    seen = False
    for k in range(end - 1, -1, -1):
        heavy_after[k] = seen
        seen = seen or order[k].op == "call_module"

    cuts: list[int] = []
    called_since_cut = False
    for k, node in enumerate(order):
        lu = last_use(node)
        if lu > k:
            live.add(node)
            dying.setdefault(lu, []).append(node)
        for v in dying.pop(k, []):
            live.discard(v)
        called_since_cut = called_since_cut or node.op == "call_module"
        if not (called_since_cut and heavy_after[k] and len(live) == 1):
            continue
        (value,) = live
        if kinds is not None and not kinds.get(value, False):
            continue  # a tuple or a Python value cannot be a block's output
        if kinds is None and _may_not_be_tensor(model, value):
            continue  # nothing ran to say what it is: cut only where it is surely a tensor
        cuts.append(k)
        called_since_cut = False
    return cuts


def _live_value(order: list[fx.Node], k: int) -> fx.Node:
    """The single value computed at or before order[k] that is used after it."""
    pos = {n: i for i, n in enumerate(order)}
    end = len(order)
    defined = [n for n in order[0].graph.nodes if n.op == "placeholder"] + order[: k + 1]
    (value,) = [v for v in defined if any(pos.get(u, end) > k for u in v.users)]
    return value


def _segment(
    model: nn.Module,
    nodes: list[fx.Node],
    inputs: list[fx.Node],
    output: fx.Node,
    original_output: fx.Node | None,
) -> fx.GraphModule:
    """A GraphModule running `nodes`; `inputs` become its placeholders, `output` its result
    (`original_output` for the last block: the model's own output node)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.node_copy(node) if node.op == "placeholder" else graph.placeholder("x")

    def lookup(arg: fx.Node) -> fx.Node:
        if arg not in env:
            if arg.op != "get_attr":
                raise AssertionError(f"value {arg.name} crosses a cut")
            env[arg] = graph.node_copy(arg)  # parameters are re-read in every block using them
        return env[arg]

    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
    if original_output is not None:
        graph.node_copy(original_output, lookup)
    else:
        graph.output(lookup(output))
    graph.lint()
    # Root = the model: referenced children and attributes are shared, not copied.
    return fx.GraphModule(model, graph, class_name="Segment")


def fx_chain(
    model: nn.Module, example: dict[str, torch.Tensor] | None = None
) -> list[tuple[str, nn.Module]]:
    """(name, module) blocks read from a trace of the model's forward (see the module doc)."""
    tracer = _LeafTracer(leaf_names(model))
    try:
        graph = tracer.trace(model)
    except Exception as exc:
        raise _not_a_chain(
            model,
            "it is neither an nn.Sequential nor a registered architecture, and torch.fx cannot "
            f"trace its forward ({type(exc).__name__}: {exc}); data-dependent control flow "
            "cannot be cut into stages automatically",
        ) from None
    gm = fx.GraphModule(model, graph)
    if example is None:
        example = _example(model)
    kinds = _tensor_kinds(model, gm, example) if example is not None else None

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (output_node,) = [n for n in gm.graph.nodes if n.op == "output"]
    order = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    if not any(n.op == "call_module" for n in order):
        raise _not_a_chain(model, "its forward calls no submodules, so there is nothing to cut")
    cuts = _cuts(model, order, kinds)
    if not cuts:
        raise _not_a_chain(
            model,
            "its forward has no point where a single tensor carries everything the rest needs "
            "(a skip connection or several live values span it), so it has no cut point",
        )

    blocks: list[tuple[str, nn.Module]] = []
    starts = [0] + [k + 1 for k in cuts]
    stops = [k + 1 for k in cuts] + [len(order)]
    incoming: list[fx.Node] = placeholders
    for i, (a, b) in enumerate(zip(starts, stops, strict=True)):
        nodes = order[a:b]
        last = i == len(starts) - 1
        out = output_node.args[0] if last else _live_value(order, b - 1)
        called = list(dict.fromkeys(str(n.target) for n in nodes if n.op == "call_module"))
        name = called[0] if len(called) == 1 else f"{called[0]}..{called[-1]}"
        only = nodes[0]
        if (
            len(nodes) == 1
            and only.op == "call_module"
            and only.args == (incoming[0],)
            and not only.kwargs
            and len(incoming) == 1
            and out is only
        ):
            module = model.get_submodule(str(only.target))
        else:
            module = _segment(model, nodes, incoming, out, output_node if last else None)
        blocks.append((name, module))
        if not last:
            incoming = [out]
    return _unique_names(blocks)


def _unique_names(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    # A child called twice (shared weights) names two blocks; keep names unique for plans.
    seen: dict[str, int] = {}
    out = []
    for name, module in blocks:
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name}#{seen[name]}", module))
    return out
