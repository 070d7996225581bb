"""Orbax checkpoints: restore onto meshes of other shapes, atomic saves, and the CLI's --save/--model."""

import json
from pathlib import Path

import orbax.checkpoint as ocp
import pytest

from dcp_jax import LLM
from dcp_jax.generate import run
from dcp_jax.weights import is_orbax_checkpoint

FIX = Path(__file__).parent / "fixtures" / "llama-gqa"
EXP = json.loads((FIX / "expected.json").read_text())


def greedy(llm):
    return llm.generate(EXP["prompts"], max_new_tokens=8, ignore_eos=True).tokens


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    llm = LLM.load(FIX, tp=2, dcp=4)
    assert llm.save(path) == 1
    assert is_orbax_checkpoint(path)
    return path


@pytest.mark.parametrize("tp,dcp", [(1, 8), (8, 1)])
def test_restore_on_another_mesh(saved, tp, dcp):
    llm = LLM.load(saved, tp=tp, dcp=dcp)
    assert llm.source.startswith("orbax checkpoint")
    assert greedy(llm) == EXP["greedy"]
    # (8, 1) replicates the 2 kv heads 4x: the checkpoint stores them once, the mesh expands them
    assert llm.model.kv_replication == (4 if tp == 8 else 1)


def test_interrupted_save_leaves_previous_checkpoint(saved, tmp_path, monkeypatch):
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    llm = LLM.load(path, tp=1, dcp=2)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("interrupted midway")

    # The weights of step 2 are written first; the save dies before its metadata is.
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "save", crash)
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", crash)
    with pytest.raises(KeyboardInterrupt):
        llm.save(path)
    monkeypatch.undo()
    steps = sorted(p.name for p in path.iterdir() if p.is_dir())
    assert "2" not in steps  # nothing that looks like a whole step 2
    again = LLM.load(path, tp=2, dcp=2)
    assert again.source.endswith("(step 1)")
    assert greedy(again) == EXP["greedy"]
    assert llm.save(path) == 2  # and the next save goes through


def test_cli_save_then_load(tmp_path, capsys):
    out = tmp_path / "saved"
    assert run(["--model", str(FIX), "--save", str(out)]) == 0
    said = capsys.readouterr().out
    assert "loaded Hugging Face checkpoint" in said and "saved orbax checkpoint" in said
    assert run(["--model", str(out), "--mesh", "tp=4,dcp=2", "--prompt-ids", ",".join(map(str, EXP["prompts"][2])),
                "--max-new-tokens", "8", "--ignore-eos", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [EXP["greedy"][2]]


def test_save_errors(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    # (--save is checked before the model loads: command-line misuse, exit 2)
    assert run(["--model", str(FIX), "--save", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err
    assert run(["--model", str(FIX), "--save", str(FIX)]) == 2
    assert "holds a Hugging Face checkpoint" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run(["--model", str(empty), "--prompt-ids", "1"]) == 1
    assert "neither a Hugging Face checkpoint (no config.json) nor an orbax" in capsys.readouterr().err


def test_dtype_auto_is_bfloat16_on_gpus_and_float32_elsewhere():
    import types

    import jax.numpy as jnp
    import numpy as np

    from dcp_jax.errors import UserError
    from dcp_jax.weights import resolve_dtype

    def mesh_on(platform):
        return types.SimpleNamespace(devices=np.asarray([types.SimpleNamespace(platform=platform)], dtype=object))

    assert resolve_dtype("auto", mesh_on("gpu")) == "bfloat16"
    assert resolve_dtype("auto", mesh_on("cpu")) == "float32"
    assert resolve_dtype("float32", mesh_on("gpu")) == "float32"  # an explicit choice stands
    with pytest.raises(UserError, match="dtype must be one of auto, float32, bfloat16, float16, got 'fp8'"):
        resolve_dtype("fp8", mesh_on("cpu"))
    llm = LLM.load(FIX, tp=1, dcp=2)  # the default, on this CPU: float32 weights and KV
    assert llm.model.embed_tokens.get_value().dtype == jnp.float32
