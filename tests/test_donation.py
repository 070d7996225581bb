"""Donation, proven with XLA's own numbers: the decode loop aliases the whole cache, its temporaries do
not grow with max_seq_len, the loop body copies no cache-shaped buffer, and the caches passed in are
consumed (deleted) by the call."""

from pathlib import Path

import jax
import numpy as np
import pytest

from dcp_jax import make_mesh
from dcp_jax.dense import Engine
from dcp_jax.sampling import SamplingParams
from dcp_jax.model import init_cache
from dcp_jax.weights import load_hf
from tests.util import copies_in_loops

FIXTURES = Path(__file__).parent / "fixtures"
B, N = 3, 8
# Two cache sizes with 1024 and 4096 slots per device (several attention blocks each), and the per-device
# shard of the first stacked cache at the larger on (2, 4): GQA (k, v) [L, B, K/tp, S/dcp, D] (both layers
# in one scanned stack); MLA one latent [L, B, 1, S/(tp·dcp), kv_lora_rank + rope] (a dense layer, then
# an MoE one: two stacks of one).
SIZES = {"llama-gqa": (4096, 16384), "deepseek-v3": (8192, 32768)}
SHARDS = {"llama-gqa": "f32[2,3,1,4096,8]", "deepseek-v3": "f32[1,3,1,4096,40]"}


@pytest.fixture(scope="module", params=sorted(SHARDS))
def engine(request):
    mesh = make_mesh(2, 4)
    model, _ = load_hf(FIXTURES / request.param, mesh)
    eng = Engine(model, mesh)
    eng.fixture = request.param
    return eng


def cache_shard_bytes(engine, layout):
    cache, _ = engine.abstract_state(B, layout)
    return sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache))


def test_decode_aliases_cache_and_temp_is_flat(engine):
    stats = {}
    small, large = SIZES[engine.fixture]
    for s in (small, large):
        layout = engine.layout(s)
        prog = engine.decode_program(B, layout, N, SamplingParams(), True)
        ma = prog.memory_analysis()
        shard = cache_shard_bytes(engine, layout)
        assert ma.alias_size_in_bytes >= shard, (ma.alias_size_in_bytes, shard)
        leaf = jax.tree.leaves(engine.abstract_state(B, layout)[0])[0]
        stats[s] = (ma.temp_size_in_bytes, shard, prog.as_text(), leaf.sharding.shard_shape(leaf.shape))
    assert stats[large][1] == 4 * stats[small][1]  # the cache did grow 4x ...
    assert stats[large][0] == stats[small][0]  # ... the temporaries did not

    # No cache-shaped copy in the loop body (a per-device cache shard, see SHARDS).
    shard_shape = "f32[%s]" % ",".join(map(str, stats[large][3]))
    assert shard_shape == SHARDS[engine.fixture]
    one_layer = "f32[%s]" % ",".join(map(str, stats[large][3][1:]))  # a layer sliced out would be a copy too
    assert copies_in_loops(stats[large][2], [shard_shape, one_layer]) == []


def test_cache_passed_in_is_deleted(engine):
    layout = engine.layout(64)
    prog = engine.decode_program(B, layout, N, SamplingParams(), True)
    cache = init_cache(engine.model, B, layout, engine.mesh, engine.dtype)
    tokens = np.zeros((B, N), np.int32)
    out = prog(engine.params, cache, tokens, np.zeros((B, N), np.float32), np.full(B, 3, np.int32),
               np.zeros(B, bool), jax.random.key(0), np.int32(1), np.int32(N))
    assert all(a.is_deleted() for a in jax.tree.leaves(cache))
    assert not any(a.is_deleted() for a in jax.tree.leaves(out[0]))
