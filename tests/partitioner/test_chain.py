"""Reading models as chains: which path each model takes, same outputs, tensor names, refusals."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import fx, nn

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio import chain as chain_module
from flowmesh.modelio.build import build_meta, build_seeded
from flowmesh.modelio.chain import Block, chain_of, first_names, register_adapter, run_chain
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close
from tests.support.archs import ARCHS, inputs_of, model_output, spec_of
from tests.support.toy_models import TOY_ALLOW


def toy(name: str) -> ModelSpec:
    return ModelSpec(name=name, factory=f"tests.support.toy_models:{name}", seed=1)


def names(blocks: list[Block]) -> list[str]:
    return [b.name for b in blocks]


def test_sequential_children_are_the_blocks():
    blocks = chain_of(build_meta(spec_of("mlp")))
    assert names(blocks) == [str(i) for i in range(7)]  # 3 x (Linear, GELU) + head
    assert blocks[0].tensor_names == {"weight": "0.weight", "bias": "0.bias"}
    assert blocks[1].tensor_names == {}
    tiny = chain_of(build_meta(spec_of("tiny_gpt")))
    assert names(tiny) == ["0", "1", "2", "3", "4"]
    assert tiny[1].tensor_names["qkv.weight"] == "1.qkv.weight"


def test_nested_plain_sequentials_are_opened():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Sequential(nn.Tanh())))
    assert names(chain_of(model)) == ["0", "1.0", "1.1.0"]


def test_resnet_is_read_through_fx_with_glue_folded():
    model = build_seeded(spec_of("small_resnet"))
    blocks = chain_of(model)
    assert names(blocks) == [
        "stem.0", "stem.1", "stem.2", "layers.0.0", "layers.1.0", "layers.2.0", "pool", "fc",
    ]  # fmt: skip
    # Children called on the previous output are the blocks themselves ...
    assert blocks[3].module is model.layers[0][0]
    # ... and the flatten between pool and fc is folded into fc's block.
    assert isinstance(blocks[-1].module, fx.GraphModule)
    assert "flatten" in blocks[-1].module.code
    assert blocks[-1].tensor_names == {"fc.weight": "fc.weight", "fc.bias": "fc.bias"}
    assert blocks[1].tensor_names["running_var"] == "stem.1.running_var"  # buffers too
    x = inputs_of("small_resnet")
    with torch.no_grad():
        assert_forward_close(run_chain(blocks, x), model(x))


def test_fx_skip_connection_and_root_parameter():
    model = build_seeded(toy("residual"), TOY_ALLOW)
    blocks = chain_of(model)
    # `b(y) + y` keeps y alive across b: b and the add are one block; relu and the root
    # parameter `scale` go with c.
    assert names(blocks) == ["a", "b", "c"]
    assert set(blocks[2].tensor_names.values()) == {"scale", "c.weight", "c.bias"}
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert_forward_close(run_chain(blocks, x), model(x))


def test_fx_two_inputs_go_to_block_zero_as_keywords():
    model = build_seeded(toy("two_inputs"), TOY_ALLOW)
    blocks = chain_of(model)
    assert names(blocks) == ["a", "b", "c"]
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        assert_forward_close(run_chain(blocks, {"x": x, "y": y}), model(x, y))


@pytest.mark.parametrize("arch", ["hf_gpt2", "hf_opt"])
def test_hf_adapters_give_the_models_logits(arch):
    model = build_seeded(spec_of(arch))
    blocks = chain_of(model)
    layers = ARCHS[arch].get("n_layer", ARCHS[arch].get("num_hidden_layers"))
    assert len(blocks) == layers + 2
    assert blocks[0].name == "embed" and blocks[-1].name == "head"
    x = inputs_of(arch)
    with torch.no_grad():
        chained, logits = run_chain(blocks, x), model_output(arch, model, x)
    assert_forward_close(chained, logits)


def test_hf_adapters_work_on_meta():
    for arch in ("hf_gpt2", "hf_opt"):
        blocks = chain_of(build_meta(spec_of(arch)))
        ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
        with torch.no_grad():
            out = run_chain(blocks, ids)
        assert out.shape == (2, 5, ARCHS[arch]["vocab_size"]) and out.device.type == "meta"


def test_tied_weights_map_to_the_first_name():
    gpt2 = chain_of(build_meta(spec_of("hf_gpt2")))
    assert gpt2[0].tensor_names["wte.weight"] == "transformer.wte.weight"
    assert gpt2[-1].tensor_names["lm_head.weight"] == "transformer.wte.weight"
    opt = chain_of(build_meta(spec_of("hf_opt")))
    assert opt[-1].tensor_names["lm_head.weight"] == "model.decoder.embed_tokens.weight"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_tensor_belongs_to_some_block(arch):
    model = build_meta(spec_of(arch))
    mapped = {o for b in chain_of(model) for o in b.tensor_names.values()}
    # Every tensor once, under its first name (tied ones: not under lm_head.weight).
    assert mapped == set(first_names(model).values())
    assert "lm_head.weight" not in mapped


def test_data_dependent_control_flow_is_refused_clearly():
    with pytest.raises(FlowmeshError) as info:
        chain_of(build_meta(toy("data_dependent"), TOY_ALLOW), whole=False)
    assert info.value.code == Code.NOT_A_CHAIN
    reason = info.value.reason
    assert "DataDependent" in reason and "control flow" in reason
    assert "nn.Sequential" in reason  # says what to do


def test_no_cut_point_is_refused_clearly():
    with pytest.raises(FlowmeshError) as info:
        chain_of(build_meta(toy("skip_all"), TOY_ALLOW), whole=False)
    assert info.value.code == Code.NOT_A_CHAIN
    assert "no cut point" in info.value.reason and "nn.Sequential" in info.value.reason


def test_an_uncuttable_model_is_one_block_that_says_why():
    model = build_meta(toy("data_dependent"), TOY_ALLOW)
    (block,) = chain_of(model)
    assert block.name == "model" and block.module is model
    assert block.tensor_names == {n: n for n in model.state_dict()}
    assert block.uncut is not None and "control flow" in block.uncut


def test_control_flow_inside_a_child_is_fine():
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.inner = build_seeded(toy("data_dependent"), TOY_ALLOW)  # a leaf: not traced

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(torch.tanh(self.first(x)))

    model = Outer()
    blocks = chain_of(model)
    assert names(blocks) == ["first", "inner"]
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert_forward_close(run_chain(blocks, x), model(x))


def test_registered_adapter_wins_over_fx(monkeypatch):
    monkeypatch.setattr(chain_module, "_ADAPTERS", dict(chain_module._ADAPTERS))

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    register_adapter(Pair, lambda m: [("only_a", m.a), ("only_b", m.b)])
    assert names(chain_of(Pair())) == ["only_a", "only_b"]


class _CallsBackWhileTraced(nn.Module):
    """Two children with a call back between them: at trace time it runs on the tracing thread,
    in the middle of the trace."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.meanwhile = meanwhile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        self.meanwhile()
        return self.b(torch.relu(x))


def _on_another_thread(call: Callable[[], object], seen: list[object]) -> Callable[[], None]:
    """A call back that runs `call` on a thread of its own and waits for it, keeping in `seen`
    what it returned or raised (the failure is the finding: reported on the main thread)."""

    def run() -> None:
        try:
            seen.append(call())
        except Exception as exc:
            seen.append(exc)

    def meanwhile() -> None:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()

    return meanwhile


def test_modules_called_on_another_thread_during_a_trace_run_as_usual():
    # The partitioner plans on a pool and the worker serves on lanes while another stage's
    # chain is read: torch.fx's patches are process-wide, and used to catch those calls.
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    x = torch.randn(2, 3)
    expected = other(x)
    seen: list[object] = []
    blocks = chain_of(_CallsBackWhileTraced(_on_another_thread(lambda: other(x), seen)))
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor), seen
    torch.testing.assert_close(seen[0], expected, rtol=0, atol=0)
    assert [b.name for b in blocks][:1] == ["a"]


def test_a_child_of_the_traced_model_called_on_another_thread_reads_its_own_parameters():
    # The traced model's own parameters are what fx hands its trace as proxies.
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    seen: list[object] = []
    model = _CallsBackWhileTraced(_on_another_thread(lambda: model.a(x), seen))
    expected = nn.functional.linear(x, model.a.weight, model.a.bias)
    chain_of(model)
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor), seen
    torch.testing.assert_close(seen[0], expected, rtol=0, atol=0)
