"""Hugging Face models from a local directory: tiny random models saved with save_pretrained
(single file and sharded), read through the adapters, planned on meta, and each stage filled with
only its own tensors from the files. Outputs are compared with the HF model's own forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_meta, build_reference
from flowmesh.modelio.chain import chain_of, first_names, run_chain
from flowmesh.modelio.hf_dir import observe_reads, supported_architectures, weight_files
from flowmesh.modelio.profile import profile
from flowmesh.modelio.stages import materialize_stage
from flowmesh.spec import ModelSpec, check_factory
from flowmesh.testing import assert_forward_close, assert_same_bits
from partitioner.stage_plans import make_stage_plan

VOCAB = 256
LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
    # Larger than the default 0.02: peaked attention and logits far from zero, so a wrong
    # position, mask or rotary frequency moves the logits well past the tolerances.
    "initializer_range": 0.2,
}


def _make(case: str) -> torch.nn.Module:
    import transformers as tf

    if case in ("llama", "llama_sharded"):
        return tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_LIKE, tie_word_embeddings=False))
    if case == "qwen2":  # tied head, as small Qwen2 checkpoints are; full then sliding layers
        cfg = tf.Qwen2Config(
            **LLAMA_LIKE,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
        )
        assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
        return tf.Qwen2ForCausalLM(cfg)
    if case == "mistral":  # a window shorter than the inputs, so the sliding mask matters
        return tf.MistralForCausalLM(tf.MistralConfig(**LLAMA_LIKE, sliding_window=4))
    if case == "gpt2":
        cfg = tf.GPT2Config(
            n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(cfg)
    raise AssertionError(case)


CASES = ["llama", "llama_sharded", "qwen2", "mistral", "gpt2"]
SHARDED = {"llama_sharded", "qwen2", "mistral"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:  # type: ignore[no-untyped-def]
    """case -> (directory, the HF model that wrote it)."""
    out = {}
    for i, case in enumerate(CASES):
        torch.manual_seed(100 + i)
        model = _make(case).eval()
        path = tmp_path_factory.mktemp(case)
        # 40 kB shards: several files, each stage's tensors spread over some of them.
        model.save_pretrained(path, max_shard_size="40KB" if case in SHARDED else "1GB")
        out[case] = (path, model)
    return out


def ids(batch: int = 2, length: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(5))


def hf_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def test_directories_are_single_file_or_sharded(saved):
    for case, (path, _) in saved.items():
        names = {p.name for p in path.iterdir()}
        assert ("model.safetensors.index.json" in names) == (case in SHARDED), names
        if case in SHARDED:
            assert len({f for f in weight_files(str(path)).values()}) > 3


@pytest.mark.parametrize("case", CASES)
def test_stages_read_only_their_tensors_and_give_the_models_logits(saved, case):
    path, hf = saved[case]
    spec = ModelSpec(name=case, hf=str(path))
    plan = make_stage_plan(spec, stages=3)
    assert plan.parts == 3
    in_files = set(weight_files(str(path)))
    x = ids()
    out = x
    read_by_stage = []
    for i in range(plan.parts):
        with observe_reads() as seen:
            stage = materialize_stage(spec, plan, i)
        own = set(stage.tensor_names.values())
        keys = [k for _, k in seen]
        # Exactly this stage's tensors, each once, every one of them from the file(s).
        assert sorted(keys) == sorted(own), (i, sorted(set(keys) ^ own))
        assert not any(t.is_meta for t in stage.state_dict().values())
        read_by_stage.append(set(keys))
        with torch.no_grad():
            out = stage(out)
    # Together the stages read every tensor of the model once (a tied one once per holder).
    assert set().union(*read_by_stage) == in_files
    assert sum(len(r) for r in read_by_stage) < 2 * len(in_files)
    assert_forward_close(out, hf_logits(hf, x))


@pytest.mark.parametrize("case", CASES)
def test_chain_on_meta_profiles_and_plans(saved, case):
    path, hf = saved[case]
    spec = ModelSpec(name=case, hf=str(path))
    model = build_meta(spec)
    assert all(t.is_meta for t in model.state_dict().values())
    blocks = chain_of(model)
    layers = hf.config.num_hidden_layers
    assert blocks[0].name == "embed" and blocks[-1].name == "head"
    assert len(blocks) == layers + 2
    # No block holds a tensor the files lack (rotary inv_freq is rebuilt, never read).
    mapped = {o for b in blocks for o in b.tensor_names.values()}
    assert mapped == set(first_names(model).values()) == set(weight_files(str(path)))
    prof = profile(spec, seq_len=7)
    assert prof.blocks[-1].out_shape == (1, 7, VOCAB)
    assert sum(prof.tensor_bytes.values()) == sum(
        t.numel() * t.element_size() for t in dict.fromkeys(hf.state_dict(keep_vars=True).values())
    )
    with torch.no_grad():
        out = run_chain(blocks, torch.zeros(2, 5, dtype=torch.long, device="meta"))
    assert out.shape == (2, 5, VOCAB) and out.is_meta


def test_tied_head_reads_the_embedding(saved):
    path, hf = saved["qwen2"]
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert "lm_head.weight" not in weight_files(str(path))
    spec = ModelSpec(name="q", hf=str(path))
    head = chain_of(build_meta(spec))[-1]
    assert head.tensor_names["lm_head.weight"] == "model.embed_tokens.weight"


@pytest.mark.parametrize("case", ["llama_sharded", "qwen2", "gpt2"])
def test_reference_is_the_directory_loaded_whole(saved, case):
    path, hf = saved[case]
    model = build_reference(ModelSpec(name=case, hf=str(path)))
    expected = hf.state_dict()
    for name, tensor in model.state_dict().items():
        assert_same_bits(tensor, expected[name], name)  # bit-exact: weights read from a file
    if case == "qwen2":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if case != "gpt2":
        inv = model.model.rotary_emb.inv_freq
        assert inv.device.type == "cpu" and inv.dtype == torch.float32
        # bit-exact: the same float32 formula on the same config, not a forward output
        assert_same_bits(inv, hf.model.rotary_emb.inv_freq)
    x = ids(1, 11)
    assert_forward_close(hf_logits(model, x), hf_logits(hf, x))


def test_bfloat16_stages_match_transformers_loading_the_directory(saved):
    from transformers import AutoModelForCausalLM

    path, _ = saved["llama_sharded"]
    spec = ModelSpec(name="bf", hf=str(path), dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    plan = make_stage_plan(spec, stages=2)
    x = ids()
    out = x
    for i in range(plan.parts):
        stage = materialize_stage(spec, plan, i)
        assert all(t.dtype == torch.bfloat16 for t in stage.state_dict().values())
        with torch.no_grad():
            out = stage(out)
    assert_forward_close(out, hf_logits(hf, x))


# -- the spec and clear refusals --------------------------------------------------------------


def test_spec_with_hf_and_no_factory(saved):
    path = str(saved["llama"][0])
    sent = {"name": "m", "factory": None, "hf": path, "kwargs": {}, "weights": None, "seed": None}
    spec = ModelSpec.from_dict(sent)
    assert spec.factory is None and spec.hf == path
    assert ModelSpec.from_dict({"name": "m", "hf": path}) == spec
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert spec.digest() != ModelSpec(name="m", hf=path + "/").digest()
    check_factory(spec.factory, ("flowmesh.examples",))  # no code from the spec runs
    # Factory specs keep the exact form they had before hf existed.
    assert "hf" not in ModelSpec(name="f", factory="flowmesh.examples:mlp").to_dict()


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"factory": "flowmesh.examples:mlp"}, "either factory or hf"),
        ({"seed": 1}, "omit seed"),
        ({"weights": "w.safetensors"}, "omit weights"),
        ({"kwargs": {"n_layer": 2}}, "no kwargs"),
        ({"hf": ""}, "local Hugging Face model directory"),
    ],
)
def test_spec_refuses_what_does_not_go_with_hf(fields, words):
    data = {"name": "m", "hf": "/some/dir", **fields}
    with pytest.raises(FlowmeshError) as info:
        ModelSpec.from_dict(data)
    assert info.value.code == Code.BAD_REQUEST and words in info.value.reason


@pytest.mark.parametrize("fields", [{"max_context": 100}, {"max_seqs": 4}, {"kv_share": 0.25}])
def test_a_factory_spec_with_generations_settings_reads_but_does_not_deploy(fields):
    # A spec stored with them (before deploys refused them) still reads back as it was.
    spec = ModelSpec.from_dict({"name": "m", "factory": "flowmesh.examples:mlp", **fields})
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(FlowmeshError) as info:
        spec.check_generation_settings()
    assert info.value.code == Code.BAD_REQUEST
    assert info.value.reason == (
        f"{next(iter(fields))}: generation's settings, for a language model deployed from a "
        "Hugging Face directory (hf=); this model is a factory's"
    )


def test_spec_without_factory_or_hf_is_refused():
    with pytest.raises(FlowmeshError) as info:
        ModelSpec.from_dict({"name": "m", "factory": None})
    assert info.value.code == Code.BAD_REQUEST and "factory" in info.value.reason


def _refusal(path: Path | str) -> str:
    with pytest.raises(FlowmeshError) as info:
        build_meta(ModelSpec(name="m", hf=str(path)))
    assert info.value.code == Code.BAD_REQUEST
    return info.value.reason


def test_missing_directory_config_or_weights_are_named(tmp_path, saved):
    assert "does not exist" in _refusal(tmp_path / "nowhere")
    assert "no config.json" in _refusal(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert "config.json is unreadable" in _refusal(tmp_path)
    # A good config without weights: planning works (meta), reading a stage says what is missing.
    src = saved["llama"][0]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    spec = ModelSpec(name="m", hf=str(tmp_path))
    plan = make_stage_plan(spec, stages=2)
    with pytest.raises(FlowmeshError) as info:
        materialize_stage(spec, plan, 0)
    assert "neither model.safetensors nor model.safetensors.index.json" in info.value.reason


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path, saved):
    config = json.loads((saved["llama"][0] / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    reason = _refusal(tmp_path)
    # Not quoted: an error never holds bytes of a file (any file can be named config.json).
    assert "BertForMaskedLM" not in reason and "not supported" in reason
    for arch in ("GPT2LMHeadModel", "OPTForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
                 "MistralForCausalLM"):  # fmt: skip
        assert arch in supported_architectures() and arch in reason
    del config["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "names no architecture" in _refusal(tmp_path)


def test_a_tensor_missing_from_its_shard_is_named(tmp_path, saved):
    src, _ = saved["llama_sharded"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = "model.layers.0.mlp.up_proj.weight"
    wrong = next(f for k, f in index["weight_map"].items() if k != victim and
                 f != index["weight_map"][victim])  # fmt: skip
    with safe_open(str(tmp_path / wrong), framework="pt") as f:
        assert victim not in set(f.keys())
    index["weight_map"][victim] = wrong
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    spec = ModelSpec(name="m", hf=str(tmp_path))
    plan = make_stage_plan(spec, stages=3)
    with pytest.raises(FlowmeshError) as info:
        for i in range(plan.parts):
            materialize_stage(spec, plan, i)
    assert victim in info.value.reason and wrong in info.value.reason


@pytest.mark.parametrize("case", CASES)
def test_a_worker_reads_each_stage_straight_from_the_directory_bit_for_bit(
    saved, case, monkeypatch
):
    # The worker's direct read (gpu_worker.stage_loader: each tensor's bytes from its shard
    # into its slot of the host buffer, one copy) against materialising the stage on the CPU
    # and copying it in: the same layout and the same bits, reading only the stage's tensors.
    import flowmesh.modelio.hf_dir
    from gpu_worker.device import CpuStandIn
    from gpu_worker.host_tier import HostStage
    from gpu_worker.stage_loader import prepare_stage

    path, _ = saved[case]
    spec = ModelSpec(name=case, hf=str(path))
    plan = make_stage_plan(spec, stages=2)
    dev = CpuStandIn(1 << 20)
    materialising_reader = flowmesh.modelio.hf_dir.read_weights
    for i in range(plan.parts):

        def no_materialising(*_a, **_k):  # the old path: tensors, then a copy into the tier
            raise AssertionError("the worker materialised the stage instead of reading it in")

        monkeypatch.setattr(flowmesh.modelio.hf_dir, "read_weights", no_materialising)
        with observe_reads() as seen:
            _blocks, host = prepare_stage(spec, plan, i, dev, ())
        monkeypatch.setattr(flowmesh.modelio.hf_dir, "read_weights", materialising_reader)
        stage = materialize_stage(spec, plan, i)
        old = HostStage.build([dict(b.state_dict(keep_vars=True)) for b in stage.blocks])
        assert sorted(k for _, k in seen) == sorted(set(stage.tensor_names.values()))
        assert host.regions == old.regions  # the same layout, ties stored once
        for b, region in enumerate(old.regions):
            for k, slot in enumerate(region.slots):
                # bit-exact: bytes read from the shards into the host tier, against a copy
                assert_same_bits(host.slot_view(b, k), old.slot_view(b, k), f"{i} {slot.name}")
