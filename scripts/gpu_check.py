"""The GPU check: the Pallas kernel compiled for real (no interpreter), timed against the jnp reference
and `jax.nn.dot_product_attention` at 8K..128K keys, its achieved bandwidth against a measured
device-to-device copy, and one end-to-end generation. Prints one JSON object.

Run through scripts/gpu_check.sh on a machine with an NVIDIA GPU (pip install -e ".[cuda,test]").
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(fn, *args, repeat=20):
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth():
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((256, 1024, 1024), jnp.float32)
    f = jax.jit(lambda a: a + 0)  # forces a full read and write
    return 2 * x.nbytes / timed(f, x)


def kernel_rows(quick: bool):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.attention import SlotPositions, attention

    b, h, kh, d = 8, 32, 8, 128
    rows = []
    for s in ([8192] if quick else [8192, 32768, 131072]):
        rng = np.random.default_rng(0)
        q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((b, kh, s, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((b, kh, s, d)), jnp.bfloat16)
        q_pos = jnp.full((b, 1), s - 1, jnp.int32)
        kv_len = jnp.full((b,), s, jnp.int32)
        pos = SlotPositions.dense(s)
        row = dict(batch=b, heads=h, kv_heads=kh, head_dim=d, keys=s)
        outs = {}
        for impl in ("pallas", "reference"):
            f = jax.jit(functools.partial(attention, kv_pos=pos, impl=impl))
            row[f"{impl}_s"] = timed(f, q, k, v, q_pos, kv_len=kv_len)
            outs[impl] = f(q, k, v, q_pos, kv_len=kv_len)[0]
        # jax.nn.dot_product_attention in its own [B, T, N, H] layout (keys/values moved once, outside)
        kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        dpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
        row["dot_product_attention_s"] = timed(dpa, q, kt, vt)
        ref = np.asarray(outs["reference"], np.float32)
        row["max_abs_diff_vs_reference"] = float(np.abs(np.asarray(outs["pallas"], np.float32) - ref).max())
        kv_bytes = k.nbytes + v.nbytes
        row["pallas_bandwidth_gbs"] = kv_bytes / row["pallas_s"] / 1e9
        row["speedup_vs_reference"] = row["reference_s"] / row["pallas_s"]
        row["speedup_vs_dot_product_attention"] = row["dot_product_attention_s"] / row["pallas_s"]
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)

    import jax

    result = dict(jax_version=jax.__version__, backend=jax.default_backend(),
                  devices=[d.device_kind for d in jax.devices()])
    if jax.default_backend() != "gpu":
        result["error"] = "no GPU backend: install the cuda extra and run on a GPU machine"
        print(json.dumps(result))
        return 1
    env = dict(os.environ, JAX_PLATFORMS="cuda", DCP_JAX_KERNEL_TESTS_ON_DEVICE="1")
    t = time.perf_counter()
    tests = subprocess.run([sys.executable, "-m", "pytest", "tests/test_kernels.py", "-q", "-x"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=400)
    result["kernel_tests"] = dict(rc=tests.returncode, tail=tests.stdout.strip().splitlines()[-1:],
                                  seconds=round(time.perf_counter() - t, 1))
    copy = copy_bandwidth()
    result["copy_bandwidth_gbs"] = copy / 1e9
    rows = kernel_rows(args.quick)
    for r in rows:
        r["fraction_of_copy_bandwidth"] = r["pallas_bandwidth_gbs"] * 1e9 / copy
    result["rows"] = rows
    gen = subprocess.run([sys.executable, "-m", "dcp_jax.generate", "--model", "tests/fixtures/llama-gqa",
                          "--prompt-ids", "52,133,217,154,209", "--max-new-tokens", "8", "--ignore-eos", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    expected = json.loads((ROOT / "tests/fixtures/llama-gqa/expected.json").read_text())["greedy"][0]
    result["generate"] = dict(rc=gen.returncode, stderr_tail=gen.stderr.strip().splitlines()[-1:])
    if gen.returncode == 0:
        out = json.loads(gen.stdout)
        result["generate"].update(tokens_match_transformers=out["tokens"][0] == expected, stats=out["stats"])
    print(json.dumps(result, indent=1))
    return 0 if tests.returncode == 0 and gen.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
