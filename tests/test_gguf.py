"""GGUF checkpoints (llama.cpp's format): a file of each supported ggml type loads to the weights
transformers' GGUF reader gives, bit for bit (tests/fixtures/gguf-types, made and recorded by
scripts/make_gguf_fixtures.py), within the type's own rounding of the floats it was quantized from,
on one device and on a tp=2 x dcp=2 mesh; and unsupported or malformed files are UserErrors."""

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from functools import cache

import gguf
import numpy as np
import pytest

from dcp_jax.errors import UserError
from dcp_jax.generate import run
from dcp_jax.llm import LLM
from tests.util import FIXTURES

GGUF_DIR = FIXTURES / "gguf-types"
EXP = json.loads((GGUF_DIR / "expected.json").read_text())
SCRIPT = FIXTURES.parent.parent / "scripts" / "make_gguf_fixtures.py"
# the types the loader supports: gguf-py quantizes the first eight; the K-quants' blocks are made
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# a small valid llama for the error cases, written at test time (F32 weights)
SMALL = {"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 32,
         "context": 128, "rope_theta": 10000.0, "rms_eps": 1e-5}


def _load_script():
    """scripts/make_gguf_fixtures.py as a module (its torch/transformers imports are in a function):
    the weights generator, the rounding bounds and the GGUF writer the fixtures were made with."""
    spec = importlib.util.spec_from_file_location("make_gguf_fixtures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MAKE = _load_script()


def sha256(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


@cache
def loaded(file: str, tp: int, dcp: int) -> dict[str, np.ndarray]:
    """Hugging Face name -> weight, as `LLM.load` reads a fixture file onto a (tp, dcp) mesh."""
    llm = LLM.load(str(GGUF_DIR / file), tp=tp, dcp=dcp)
    return {name: np.asarray(value) for name, value in llm.model.hf_weights().items()}


def tensors_of(qtype: str) -> list[tuple[str, str]]:
    """[(fixture file, Hugging Face name)] of the tensors stored as `qtype`."""
    return [(file, name) for file, rec in EXP["files"].items()
            for name, t in rec["tensors"].items() if t["type"] == qtype]


def hash_problem(file: str, name: str, got: np.ndarray) -> str | None:
    """None when `got` is transformers' float32 weight bit for bit, else what differs (the largest
    difference at the recorded sample indices)."""
    exp = EXP["files"][file]["tensors"][name]
    where = f"{file} {name} ({exp['type']})"
    if got.dtype != np.float32:
        return f"{where}: dtype {got.dtype}, transformers' is float32"
    if list(got.shape) != exp["shape"]:
        return f"{where}: shape {list(got.shape)}, transformers' is {exp['shape']}"
    if sha256(got) == exp["sha256"]:
        return None
    idx = np.array([i for i, _ in exp["samples"]])
    ref = np.array([v for _, v in exp["samples"]], np.float32)
    diff = np.abs(got.ravel()[idx].astype(np.float64) - ref)
    worst = int(diff.argmax())
    i = int(idx[worst])
    return (f"{where}: float32 bytes differ from transformers'; max |difference| at the {len(idx)} "
            f"sampled indices {diff[worst]:.6g} (flat index {i}: {float(got.ravel()[i])!r} vs "
            f"{float(ref[worst])!r})")


def original(exp: dict) -> np.ndarray:
    """The float weights a quantizer-backed tensor was made from, regenerated (the record's hash
    holds them to the script's run)."""
    rec = exp["original"]
    x = MAKE.original_weights(rec["seed"], tuple(exp["shape"]), norm=rec["norm"])
    assert sha256(x.astype(np.float32)) == rec["sha256"], "the original weights did not regenerate"
    return x


def rounding_problem(file: str, name: str, got: np.ndarray) -> str | None:
    """None when `got` lies within its type's rounding of the original floats, else the worst
    element."""
    exp = EXP["files"][file]["tensors"][name]
    x = original(exp)
    err = np.abs(got.astype(np.float64) - x)
    bound = MAKE.rounding_bound(gguf.GGMLQuantizationType[exp["type"]], x)
    if np.all(err <= bound):
        return None
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    return (f"{file} {name} ({exp['type']}): off the original floats by {err[worst]:.6g} at "
            f"{tuple(map(int, worst))}, past the type's rounding {bound[worst]:.6g} there")


def test_fixtures_cover_every_type():
    assert set(TYPES) <= {t for rec in EXP["files"].values() for t in rec["types"]}
    for file, rec in EXP["files"].items():
        data = (GGUF_DIR / file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == rec["sha256"], f"{file} is not the recorded file"
    for file, rec in EXP["files"].items():  # every float-quantized tensor regenerates its floats
        for exp in rec["tensors"].values():
            if exp["original"] is not None:
                assert original(exp).shape == tuple(exp["shape"])


def _stored(file: str, gguf_name: str) -> np.ndarray:
    reader = gguf.GGUFReader(GGUF_DIR / file)
    tensor = next(t for t in reader.tensors if t.name == gguf_name)
    return gguf.quants.dequantize(tensor.data, tensor.tensor_type)


@pytest.mark.parametrize("file", sorted(EXP["files"]))
def test_fixtures_store_q_and_k_permuted(file):
    # The files hold attn_q/attn_k with llama.cpp's converter's row order, not Hugging Face's: a
    # reader that does not undo it fails test_type_loads. Per head (h of them: heads for q, KV
    # heads for k), rows (2, d/2) were swapped to (d/2, 2); undone as transformers does it.
    cfg = EXP["config"]
    for name, exp in EXP["files"][file]["tensors"].items():
        heads = {"q_proj": cfg["heads"], "k_proj": cfg["kv_heads"]}.get(name.split(".")[-2])
        if heads is None:
            continue
        w = _stored(file, exp["gguf_name"])
        rows = w.shape[0]
        hf = w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(2, 1).reshape(w.shape)
        assert sha256(w) != exp["sha256"] and sha256(hf) == exp["sha256"], (file, name)


@pytest.mark.parametrize("qtype", TYPES)
def test_type_loads(qtype):
    # each tensor of the type equals transformers' float32 weight (SHA-256 of its bytes), and, where
    # it was quantized from known floats, lies within the type's rounding of them
    cases = tensors_of(qtype)
    assert cases, f"no fixture tensor is {qtype}: rerun scripts/make_gguf_fixtures.py"
    problems = []
    for file, name in cases:
        weights = loaded(file, 1, 1)
        if name not in weights:
            problems.append(f"{file}: the loaded model has no {name}")
            continue
        problems.append(hash_problem(file, name, weights[name]))
        if EXP["files"][file]["tensors"][name]["original"] is not None:
            problems.append(rounding_problem(file, name, weights[name]))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("file", sorted(EXP["files"]))
def test_load_gives_every_tensor_and_no_other(file):
    assert sorted(loaded(file, 1, 1)) == sorted(EXP["files"][file]["tensors"])


@pytest.mark.parametrize("file", sorted(EXP["files"]))
def test_sharded_load_gives_the_same_weights(file):
    # each device reads its shard of the blocks: tp=2 x dcp=2 gives the one-device weights
    weights = loaded(file, 2, 2)
    assert sorted(weights) == sorted(EXP["files"][file]["tensors"])
    problems = [hash_problem(file, name, weights[name]) for name in sorted(weights)]
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems)


# -------------------------------------------------------------------------------------------------
# Errors. The files are written here, with the writer the fixtures were made with.


def small_gguf(path, edit=None, arch: str = "llama"):
    """A valid small llama GGUF (F32, q/k permuted) at `path`; `edit` changes its tensor list."""
    tensors = MAKE.float_tensors("test-gguf", 1, SMALL)
    MAKE.write_gguf(path, edit(tensors) if edit else tensors, 1, SMALL, arch=arch)
    return path


def loaded_small(path) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in LLM.load(str(path)).model.hf_weights().items()}


def test_small_gguf_loads(tmp_path):
    # the error cases' base file is valid: each error below comes from its one defect
    weights = loaded_small(small_gguf(tmp_path / "model.gguf"))
    for name, shape in MAKE.hf_shapes(1, SMALL).items():
        x = MAKE.original_weights(MAKE.seed_of("test-gguf", name), shape, norm=len(shape) == 1)
        assert np.array_equal(weights[MAKE.hf_name(name)], x), name


def load_error(path) -> str:
    """The UserError `LLM.load(path)` raises, its message with the path taken out (the test's
    directory is named after the test, so the path could hold the words a message must)."""
    with pytest.raises(UserError) as err:
        LLM.load(str(path))
    return str(err.value).replace(str(path), "<path>").replace(str(path.parent), "<dir>")


def test_unsupported_architecture(tmp_path):
    msg = load_error(small_gguf(tmp_path / "model.gguf", arch="rwkv6"))
    assert "rwkv6" in msg, msg


def test_type_gguf_cannot_dequantize(tmp_path):
    # Q8_1 (llama.cpp's activation type) has no dequantizer in the gguf package
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q8_1]
    with pytest.raises(NotImplementedError):
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), q8_1)
    rows, cols = SMALL["intermediate"], SMALL["hidden"]
    blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // block * size), np.uint8)

    def edit(tensors):
        return [(n, blocks, q8_1) if n == "blk.0.ffn_up.weight" else (n, d, t)
                for n, d, t in tensors]

    msg = load_error(small_gguf(tmp_path / "model.gguf", edit))
    assert "Q8_1" in msg, msg
    assert "blk.0.ffn_up.weight" in msg or "model.layers.0.mlp.up_proj.weight" in msg, msg


def truncated(tmp_path, keep: float = 0.5):
    data = (GGUF_DIR / "quant-types.gguf").read_bytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(data[:int(len(data) * keep)] if keep < 1 else data[:int(keep)])
    return path


@pytest.mark.parametrize("keep", [0.5, 100], ids=["half", "in-metadata"])
def test_truncated_file(tmp_path, keep):
    msg = load_error(truncated(tmp_path, keep))
    assert re.search(r"(?i)truncat|corrupt", msg), msg


def test_missing_tensor(tmp_path):
    def edit(tensors):
        return [t for t in tensors if t[0] != "blk.0.ffn_down.weight"]

    msg = load_error(small_gguf(tmp_path / "model.gguf", edit))
    assert "blk.0.ffn_down.weight" in msg or "model.layers.0.mlp.down_proj.weight" in msg, msg


def test_cli_reports_a_broken_gguf(tmp_path, capsys):
    # one "error: " line and exit code 1 (a run error), in process and in a fresh one (no traceback)
    path = truncated(tmp_path)
    code = run(["--model", str(path), "--prompt-ids", "1,2,3"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "", err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    words = err.replace(str(path), "").replace(str(tmp_path), "")
    assert re.search(r"(?i)truncat|corrupt", words), err
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run([sys.executable, "-m", "dcp_jax.generate", "--model", str(path),
                        "--prompt-ids", "1,2,3"], capture_output=True, text=True, env=env,
                       timeout=300, check=False)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == err.strip(), p.stderr


# --- other architectures: the Hugging Face fixtures written as GGUF files give their tokens ------

def hf_to_gguf(fixture: str, path) -> None:
    """tests/fixtures/<fixture> (float32 safetensors, random weights, no tokenizer) as a GGUF file
    of its architecture through the fixtures' writer, tensors named as llama.cpp's converter names
    them (qwen2 and qwen3 keep Q/K rows in Hugging Face order: only llama's are permuted)."""
    from safetensors.numpy import load_file

    cfg = json.loads((FIXTURES / fixture / "config.json").read_text())
    arch, layers = cfg["model_type"], cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)
    f32 = gguf.GGMLQuantizationType.F32
    tensors = [(names.get_name(name, try_suffixes=(".weight", ".bias")), x, f32)
               for name, x in sorted(load_file(FIXTURES / fixture / "model.safetensors").items())]
    meta = {"hidden": cfg["hidden_size"], "heads": cfg["num_attention_heads"],
            "kv_heads": cfg["num_key_value_heads"], "intermediate": cfg["intermediate_size"],
            "vocab": cfg["vocab_size"], "context": cfg["max_position_embeddings"],
            "rope_theta": cfg["rope_parameters"]["rope_theta"], "rms_eps": cfg["rms_norm_eps"]}
    if cfg.get("head_dim"):
        meta["head_dim"] = cfg["head_dim"]
    MAKE.write_gguf(path, tensors, layers, meta, arch=arch)


@pytest.mark.parametrize("fixture", ["qwen2", "qwen3"])
def test_other_architectures_give_transformers_tokens(tmp_path, fixture):
    path = tmp_path / f"{fixture}.gguf"
    hf_to_gguf(fixture, path)
    exp = json.loads((FIXTURES / fixture / "expected.json").read_text())
    llm = LLM.load(str(path), tp=1, dcp=2, dtype="float32", max_model_len=64)
    out = llm.generate(exp["prompts"], max_new_tokens=exp["max_new_tokens"], ignore_eos=True)
    assert out.tokens == exp["greedy"]
    np.testing.assert_allclose(out.logprobs, exp["greedy_logprobs"], atol=1e-4)
