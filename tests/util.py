"""Shared test helpers: a float64 NumPy oracle, cache placement through the layout, and generation on
the transformers fixtures (tests/fixtures, made by scripts/make_fixtures.py)."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import numpy as np

from dcp_jax.layout import KVLayout

FIXTURES = Path(__file__).parent / "fixtures"

# a chat template for the llama-tokenizer fixture (which ships none): role tags, one line a message
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def templated_checkpoint(directory: Path, template: str = TEMPLATE) -> Path:
    """The llama-tokenizer fixture copied to `directory`, its tokenizer_config given `template`."""
    shutil.copytree(FIXTURES / "llama-tokenizer", directory)
    path = directory / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = template
    path.write_text(json.dumps(cfg))
    return directory


def expected(name):
    """The fixture's reference outputs from transformers (see scripts/make_fixtures.py)."""
    return json.loads((FIXTURES / name / "expected.json").read_text())


def run_fixture(name, tp, dcp, **kw):
    """Greedy generation of the fixture's prompts on a (tp, dcp) mesh -> (Generation, expected).

    Keywords: q_gather, interleave, combine (model/engine options); the rest go to Engine.generate
    (max_seq_len: the fixture's own where it has one, the context its dynamic RoPE base is for).
    """
    from dcp_jax import make_mesh
    from dcp_jax.dense import Engine
    from dcp_jax.weights import load_hf

    mesh = make_mesh(tp, dcp)
    model, _ = load_hf(FIXTURES / name, mesh, q_gather=kw.pop("q_gather", False))
    exp = expected(name)
    eng = Engine(model, mesh, interleave=kw.pop("interleave", 1), combine=kw.pop("combine", "auto"))
    kw.setdefault("max_seq_len", exp.get("max_seq_len"))
    return eng.generate(exp["prompts"], max_new_tokens=exp["max_new_tokens"], ignore_eos=True, **kw), exp


def dense_attention(q, k, v, q_pos, lengths, scale, kv_pos=None):
    """Float64 oracle. q [B,T,H,Dk]; k [B,K,L,Dk], v [B,K,L,Dv] hold positions kv_pos (default 0..L-1).

    A key is seen iff kv_pos <= q_pos and kv_pos < length. Returns (o [B,T,H,Dv], lse [B,T,H]); rows
    that see no key give o = 0, lse = -inf.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    q_pos, lengths = np.asarray(q_pos), np.asarray(lengths)
    b, t, h, _ = q.shape
    g = h // k.shape[1]
    pos = np.arange(k.shape[2]) if kv_pos is None else np.asarray(kv_pos)
    o = np.zeros((b, t, h, v.shape[-1]))
    lse = np.full((b, t, h), -np.inf)
    for bi in range(b):
        for ti in range(t):
            mask = (pos <= q_pos[bi, ti]) & (pos < lengths[bi])
            if not mask.any():
                continue
            for hi in range(h):
                s = k[bi, hi // g][mask] @ q[bi, ti, hi] * scale
                m = s.max()
                p = np.exp(s - m)
                o[bi, ti, hi] = p @ v[bi, hi // g][mask] / p.sum()
                lse[bi, ti, hi] = m + np.log(p.sum())
    return o, lse


def place(kv, layout: KVLayout):
    """Put position-ordered kv [B, K, L, D] (L <= max_seq_len) into a zeroed cache in layout order."""
    b, kh, length, d = kv.shape
    cache = np.zeros((b, kh, layout.max_seq_len, d), kv.dtype)
    cache[:, :, layout.cache_index(np.arange(length))] = kv
    return cache


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def assert_lse_close(lse, ref, tol):
    lse, ref = np.asarray(lse, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    finite = np.isfinite(ref)
    assert not np.isnan(lse).any()
    if finite.any():
        err = np.max(np.abs(lse[finite] - ref[finite]) / np.maximum(1.0, np.abs(ref[finite])))
        assert err <= tol, f"lse error {err} > {tol}"


def loop_bodies(hlo: str):
    """The text of every computation used as a while-loop body."""
    bodies = set(re.findall(r"while\([^)]*\)[^\n]*body=%?([\w.\-]+)", hlo))
    comps = {}
    for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo, re.S | re.M):
        comps[m.group(1)] = m.group(2)
    return [comps[b] for b in bodies]


def copies_in_loops(hlo: str, shapes) -> list[str]:
    """Lines of the while-loop bodies of compiled HLO text that copy a buffer of one of `shapes` (HLO type
    strings such as "f32[2,3,1,4096,8]"; the first is the buffer itself, e.g. a cache shard, the others
    parts of it, e.g. one layer). Asserts the module has a loop and names the first shape, so an empty
    answer means something."""
    bodies = loop_bodies(hlo)
    assert bodies, "no while loop found in the program"
    assert shapes[0] in hlo, f"{shapes[0]} appears nowhere in the program"
    return [line for body in bodies for line in body.splitlines()
            if re.search(r"\b(copy|copy-start)\(", line)
            and any(shape in line.split("=")[1].split("(")[0] for shape in shapes)]


class LocalStore:
    """The lockstep's key-value store inside one process (`dcp_jax.serving.lockstep.RuntimeStore`'s
    calls): a leader and a follower engine on one machine."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def put(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes | None:
        with self.changed:
            self.changed.wait_for(lambda: key in self.values, timeout_s)
            return self.values.get(key)

    def try_get(self, key: str) -> bytes | None:
        with self.changed:
            return self.values.get(key)

    def delete(self, key: str) -> None:
        with self.changed:
            self.values.pop(key, None)
