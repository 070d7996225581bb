"""DeepSeek-V3's FP8 block-scaled checkpoints (tests/fixtures/deepseek-v3-fp8, made by
scripts/make_fp8_fixture.py: every linear weight float8_e4m3fn with per-block `_scale_inv`, blocks
[16, 16] with partial ones): dequantized shard by shard as they load, they give transformers' greedy
tokens of the dequantized checkpoint on 1x1, 2x4 and 8x1; and the errors of malformed ones."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dcp_jax import LLM
from dcp_jax.errors import UserError
from tests.util import FIXTURES

FP8 = FIXTURES / "deepseek-v3-fp8"
EXP = json.loads((FP8 / "expected.json").read_text())


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 4), (8, 1)])
def test_fp8_checkpoint_gives_the_dequantized_reference(tp, dcp):
    llm = LLM.load(FP8, tp=tp, dcp=dcp, page_size=4)
    out = llm.generate(EXP["prompts"], max_new_tokens=EXP["max_new_tokens"], ignore_eos=True)
    assert out.tokens == EXP["greedy"]
    assert EXP["greedy"] != EXP["unquantized_greedy"]  # (the fp8 weights are what was read, not a float copy)


def test_each_device_reads_its_blocks():
    # a weight split over 8 devices: each shard equals the dequantized slice it holds (partial blocks
    # included: kv_a_proj_with_mqa is 40 rows, 2.5 blocks of 16)
    import ml_dtypes

    llm = LLM.load(FP8, tp=8, dcp=1, page_size=4)
    raw = load_file(str(FP8 / "model.safetensors"))
    name = "model.layers.0.self_attn.q_b_proj.weight"
    q, s = raw[name].astype(np.float32), raw[name + "_scale_inv"]
    full = q * np.repeat(np.repeat(s, 16, 0), 16, 1)[:q.shape[0], :q.shape[1]]
    assert raw[name].dtype == ml_dtypes.float8_e4m3fn
    w = llm.model.stacks[0].block.self_attn.q_b_proj[...]
    assert w.shape[-2:] in (full.shape, full.T.shape)
    got = np.asarray(w)[0]
    np.testing.assert_array_equal(got if got.shape == full.shape else got.T, full)
    assert len({sh.device for sh in w.addressable_shards}) == 8 and any(
        sh.data.size < w.size for sh in w.addressable_shards)


def _copy(tmp_path, edit_config=None, drop=None):
    out = tmp_path / "ckpt"
    shutil.copytree(FP8, out)
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if drop:
        t = load_file(str(out / "model.safetensors"))
        save_file({k: v for k, v in t.items() if k != drop}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("case,match", [
    ("awq", "quantization 'awq' .* is not supported: dcp_jax reads fp8 e4m3 block-scaled checkpoints"),
    ("block", "weight_block_size must be two positive integers"),
    ("no_config", "_scale_inv is in the checkpoint but config.json has no fp8 quantization_config"),
    ("no_scale", "an fp8 weight has no _scale_inv tensor beside it"),
])
def test_malformed_fp8_checkpoints_are_refused(tmp_path, case, match):
    edits = {"awq": lambda c: c["quantization_config"].update(quant_method="awq"),
             "block": lambda c: c["quantization_config"].update(weight_block_size=[16]),
             "no_config": lambda c: c.pop("quantization_config")}
    drop = "model.layers.0.self_attn.o_proj.weight_scale_inv" if case == "no_scale" else None
    with pytest.raises(UserError, match=match):
        LLM.load(_copy(tmp_path, edits.get(case), drop), tp=1, dcp=1)
