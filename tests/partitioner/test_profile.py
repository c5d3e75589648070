"""Profiles: bytes per block (tied weights once), activations on meta, times, plain data."""

from __future__ import annotations

import msgpack
import pytest

from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.build import build_seeded
from flowmesh.modelio.costs import ModelProfile, human_bytes
from flowmesh.modelio.profile import profile
from flowmesh.spec import ModelSpec
from tests.support.archs import ARCHS, spec_of
from tests.support.toy_models import TOY_ALLOW


def unique_state_bytes(spec: ModelSpec) -> int:
    """The model's state_dict bytes, each tensor once (tied weights share a storage)."""
    seen = {}
    for t in build_seeded(spec).state_dict().values():
        seen.setdefault(t.untyped_storage().data_ptr(), t.numel() * t.element_size())
    return sum(seen.values())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_block_bytes_sum_to_the_models_bytes(arch):
    spec = spec_of(arch)
    prof = profile(spec)
    assert prof.total_bytes == unique_state_bytes(spec)
    assert sum(prof.tensor_bytes.values()) == prof.total_bytes
    assert prof.spec_digest == spec.digest()
    assert prof.range_bytes(0, len(prof.blocks)) == prof.total_bytes


def test_tied_weight_counted_once_and_shared_by_the_head():
    prof = profile(spec_of("hf_gpt2"))
    wte = ARCHS["hf_gpt2"]["vocab_size"] * ARCHS["hf_gpt2"]["n_embd"] * 4
    head = prof.blocks[-1]
    assert head.shared_bytes == wte
    assert head.param_bytes == 2 * ARCHS["hf_gpt2"]["n_embd"] * 4  # ln_f weight and bias
    assert "transformer.wte.weight" in head.tensors
    # A stage of just the head holds wte too; with the embedding, once.
    n = len(prof.blocks)
    assert prof.range_bytes(n - 1, n) == head.param_bytes + wte
    assert prof.range_bytes(0, n) == prof.total_bytes


def test_activations_exact_for_mlp():
    prof = profile(spec_of("mlp"), batch=4)
    width = ARCHS["mlp"]["width"]
    for block in prof.blocks:
        assert block.out_shape == (4, width)
        assert block.out_bytes_per_sample == width * 4
        # Linear saves its input for the weight gradient, GELU its input: one row each.
        assert block.saved_bytes_per_sample == width * 4
    assert prof.blocks[0].param_bytes == (width * width + width) * 4


def test_seq_len_sets_free_dimensions():
    short = profile(spec_of("tiny_gpt"), seq_len=1)
    long = profile(spec_of("tiny_gpt"), batch=4, seq_len=8)
    d, vocab = ARCHS["tiny_gpt"]["d_model"], ARCHS["tiny_gpt"]["vocab"]
    assert [b.out_bytes_per_sample for b in short.blocks] == [d * 4] * 4 + [vocab * 4]
    assert [b.out_bytes_per_sample for b in long.blocks] == [8 * d * 4] * 4 + [8 * vocab * 4]
    assert long.blocks[-1].out_shape == (4, 8, vocab)
    # ids (8 x int64 per sample) and the positions shared by the batch (8 x int64 / 4).
    assert long.blocks[0].saved_bytes_per_sample == 8 * 8 + 8 * 8 // 4
    assert all(b.saved_bytes_per_sample > b.out_bytes_per_sample for b in long.blocks[1:4])


def test_batchnorm_buffers_and_saved_statistics():
    prof = profile(spec_of("small_resnet"), batch=4)
    bn = prof.blocks[1]
    assert bn.name == "stem.1"
    channels = ARCHS["small_resnet"]["width"]
    assert bn.param_bytes == 2 * channels * 4
    assert bn.buffer_bytes == 2 * channels * 4 + 8  # running mean, var; num_batches_tracked
    # input + saved mean and inverse std (per channel, shared by the batch of 4)
    assert bn.saved_bytes_per_sample == channels * 16 * 16 * 4 + 2 * channels * 4 // 4
    assert prof.blocks[-2].saved_bytes_per_sample == 0  # average pooling saves nothing


def test_undeclared_inputs_give_bytes_only():
    spec = ModelSpec(name="u", factory="tests.support.toy_models:undeclared")
    prof = profile(spec, allow=TOY_ALLOW, measure_device="cpu")
    assert prof.inputs is None and prof.device is None
    assert [b.param_bytes for b in prof.blocks] == [(8 * 16 + 16) * 4, 0, (16 * 4 + 4) * 4, 32]
    assert prof.blocks[3].buffer_bytes == 4 * 4 * 2 + 8
    for b in prof.blocks:
        assert (b.out_bytes_per_sample, b.saved_bytes_per_sample, b.out_shape) == (0, 0, None)
        assert b.forward_s is None and b.forward_backward_s is None


def test_measured_times_on_cpu():
    prof = profile(spec_of("tiny_gpt"), batch=2, seq_len=4, measure_device="cpu", repeats=2)
    assert prof.device == "cpu" and prof.timed
    for b in prof.blocks:
        assert b.forward_s is not None and b.forward_s > 0
        assert b.forward_backward_s is not None and b.forward_backward_s > 0


def test_profile_round_trips_through_msgpack():
    prof = profile(spec_of("hf_opt"), batch=2, seq_len=3)
    data = msgpack.unpackb(msgpack.packb(prof.to_dict()))
    assert data["total_bytes"] == prof.total_bytes
    assert ModelProfile.from_dict(data) == prof


def test_profile_from_dict_rejects_garbage():
    good = profile(spec_of("mlp")).to_dict()
    for broken in (
        {**good, "blocks": []},
        {**good, "blocks": [{**good["blocks"][0], "param_bytes": -1}]},
        {**good, "blocks": [{**good["blocks"][0], "forward_s": "fast"}]},
        {**good, "surprise": 1},
        {**good, "tensor_bytes": {}, "blocks": good["blocks"], "spec_digest": 3},
        {**good, "tensor_bytes": {"0.weight": 1}},
    ):
        with pytest.raises(FlowmeshError) as info:
            ModelProfile.from_dict(broken)
        assert info.value.code == Code.PLAN_ERROR


def test_bad_arguments():
    with pytest.raises(FlowmeshError) as info:
        profile(spec_of("mlp"), batch=0)
    assert info.value.code == Code.BAD_REQUEST
    with pytest.raises(FlowmeshError):
        profile(spec_of("mlp"), measure_device="meta")


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
