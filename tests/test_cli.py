"""The command line: JSON output, and one clear stderr line + exit code for every user mistake."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_jax.generate import run

FIX = Path(__file__).parent / "fixtures"
LLAMA = str(FIX / "llama-gqa")
CONFIG = str(FIX / "llama-gqa" / "config.json")  # a file where a directory is wanted


def cli(capsys, *argv):
    code = run([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output(capsys):
    code, out, err = cli(capsys, "--model", FIX / "llama-tokenizer", "--mesh", "tp=2,dcp=4", "--prompt", "Return the",
                         "--prompt-ids", "5,6,7,8", "--max-new-tokens", "5", "--ignore-eos", "--logprobs", "--json",
                         "--top-logprobs", "3")
    assert code == 0, err
    obj = json.loads(out)
    assert [len(t) for t in obj["tokens"]] == [5, 5]
    assert len(obj["text"]) == 2 and all(isinstance(t, str) for t in obj["text"])
    assert [len(x) for x in obj["logprobs"]] == [5, 5] and all(x <= 0 for x in obj["logprobs"][0])
    # greedy: each token's first of its 3 alternatives is itself
    assert [[alts[0][0] for alts in req] for req in obj["top_logprobs"]] == obj["tokens"]
    assert all(len(alts) == 3 for req in obj["top_logprobs"] for alts in req)
    stats = obj["stats"]
    assert (stats["tp"], stats["dcp"]) == (2, 4)
    for key in ("kv_bytes_per_device", "kv_bytes_total", "ttft_s", "decode_tokens_per_s"):
        assert stats[key] > 0
    assert stats["kv_bytes_per_device"] * 8 == stats["kv_bytes_total"]


def test_sampling_flags_are_generate_arguments(capsys):
    # --min-p, the penalties and --bad-word reach LLM.generate as its keywords (the fixture's reference)
    case = json.loads((FIX / "llama-gqa" / "processors.json").read_text())["cases"][1]
    pen = case["penalties"][2]["params"]
    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", ",".join(map(str, case["prompt"])),
                         "--max-new-tokens", "12", "--ignore-eos", "--json", "--min-p", "0.01",
                         "--repetition-penalty", pen["repetition_penalty"], "--presence-penalty", pen["presence_penalty"],
                         "--frequency-penalty", pen["frequency_penalty"])
    assert code == 0, err
    assert json.loads(out)["tokens"] == [case["penalties"][2]["tokens"]]  # (greedy: min_p changes nothing)
    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", "1,2", "--bad-word", "the")
    assert code == 1 and err == "error: bad_words as text needs a tokenizer: give them as token id lists\n"


def test_request_surface_flags_are_generate_arguments(capsys, tmp_path):
    # each flag reaches LLM.generate: what the CLI prints is what the call gives with the same keywords
    from dcp_jax import LLM, SamplingParams

    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "4", "--ignore-eos",
                         "--logit-bias", "9=100", "--prompt-logprobs", "2", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert obj["tokens"] == [[9, 9, 9, 9]]  # the bias wins every greedy choice
    ref = LLM.load(LLAMA).generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                  prompt_logprobs=2))
    assert obj["prompt_logprobs"] == ref.prompt_logprobs and len(obj["prompt_logprobs"][0]) == 4
    assert obj["prompt_top_logprobs"] == json.loads(json.dumps(ref.prompt_top_logprobs))
    # EOS (id 2) pushed up, held back for --min-tokens; n samples with their own seeds, allowed ids only
    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "8",
                         "--logit-bias", "2=100", "--min-tokens", "3", "--json")
    assert code == 0, err
    assert json.loads(out)["tokens"][0][3:] == [2] and 2 not in json.loads(out)["tokens"][0][:3]
    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--ignore-eos",
                         "--allowed-token-ids", "11,12,13", "--n", "3", "--temperature", "1", "--seed", "4", "--json")
    assert code == 0, err
    tokens = json.loads(out)["tokens"]
    assert len(tokens) == 3 and len({tuple(t) for t in tokens}) > 1 and set(sum(tokens, [])) <= {11, 12, 13}
    assert tokens == LLM.load(LLAMA).generate([[5, 6, 7, 8]], SamplingParams(
        max_tokens=6, ignore_eos=True, n=3, allowed_token_ids=[11, 12,
                                                               13], temperature=1.0, seed=4)).tokens
    # --stop-token-ids: the output ends at the first one (greedy: the same tokens up to it)
    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", "5,6,7,8", "--max-new-tokens",
                         "6", "--json")
    greedy = json.loads(out)["tokens"][0]
    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", "5,6,7,8", "--max-new-tokens",
                         "6", "--json",
                         "--stop-token-ids", str(greedy[2]))
    assert code == 0, err
    assert json.loads(out)["tokens"][0] == greedy[:greedy.index(greedy[2]) + 1]
    # structured outputs: a choice, a schema given as a file
    tok = FIX / "llama-tokenizer"
    code, out, err = cli(capsys, "--model", tok, "--prompt", "Answer:", "--choice", "yes", "--choice", "no", "--json")
    assert code == 0, err
    assert json.loads(out)["text"][0] in ("yes", "no")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, out, err = cli(capsys, "--model", tok, "--prompt", "Return the", "--json-schema", tmp_path / "schema.json",
                         "--max-new-tokens", "24", "--json")
    assert code == 0, err
    assert set(json.loads(json.loads(out)["text"][0])) == {"n"}


def test_text_output(capsys):
    code, out, err = cli(capsys, "--model", LLAMA, "--dcp", "2", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
                         "--max-new-tokens", "3")
    assert code == 0, err
    assert out.startswith("[0] [") and "\n[1] [" in out and "tp=1 x dcp=2" in out
    assert "KV cache" in out and "TP alone" in out


def test_single_prompt_streams(capsys):
    code, out, err = cli(capsys, "--model", FIX / "llama-tokenizer", "--prompt", "Return the", "--max-new-tokens", "4",
                         "--ignore-eos")
    assert code == 0, err
    assert not out.startswith("[0]") and "TTFT" in out and "model       Hugging Face checkpoint" in out


def test_ids_stream_without_a_tokenizer(capsys):
    exp = json.loads((FIX / "llama-gqa" / "expected.json").read_text())
    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", ",".join(map(str, exp["prompts"][0])),
                         "--max-new-tokens", "8", "--ignore-eos")
    assert code == 0, err
    assert out.splitlines()[0] == " ".join(map(str, exp["greedy"][0]))  # one line, each id once


def test_deepseek_report(capsys):
    exp = json.loads((FIX / "deepseek-v3" / "expected.json").read_text())
    code, out, err = cli(capsys, "--model", FIX / "deepseek-v3", "--mesh", "tp=2,dcp=4", "--prompt-ids",
                         ",".join(map(str, exp["prompts"][1])), "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert obj["tokens"] == [exp["greedy"][1]]
    assert obj["stats"]["kv_bytes_per_device"] * 8 == obj["stats"]["kv_bytes_total"]
    code, out, err = cli(capsys, "--model", FIX / "deepseek-v3", "--mesh", "tp=8,dcp=1", "--prompt-ids", "1,2",
                         "--max-new-tokens", "2")
    assert code == 0, err
    assert "the MLA latent has no head axis: 8.0x more" in out


def _broken(tmp_path, edit):
    d = tmp_path / "model"
    shutil.copytree(LLAMA, d)
    edit(d)
    return d


def _set_config(**kv):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(kv)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _truncate(d):
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


USAGE = [
    (["--model", LLAMA], "no prompt"),
    (["--model", LLAMA, "--prompt-ids", "1,x"], "comma-separated integers"),
    (["--model", LLAMA, "--prompt-ids", "1", "--tp", "0"], "--tp must be >= 1"),
    (["--model", LLAMA, "--prompt-ids", "1", "--dcp", "two"], "--dcp must be an integer"),
    (["--model", LLAMA, "--prompt-ids", "1", "--mesh", "tp=2"], "--mesh takes tp=N,dcp=M"),
    (["--model", LLAMA, "--prompt-ids", "1", "--mesh", "tp=2,dcp=2", "--tp", "2"], "either --mesh or --tp"),
    (["--model", LLAMA, "--prompt-ids", "1", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--model", LLAMA, "--prompt-ids", "1", "--top-p", "0"], "--top-p must be in (0, 1], got 0"),
    (["--model", LLAMA, "--prompt-ids", "1", "--kv-cache-memory", "lots"], "--kv-cache-memory: memory size 'lots'"),
    (["--model", LLAMA, "--prompt-ids", "1", "--kv-cache-memory", "1MiB", "--gpu-memory-utilization", "0.5"],
     "not both"),
    (["--model", LLAMA, "--prompt-ids", "1", "--kv-host-memory", "0"], "--kv-host-memory: memory size '0'"),
    (["--model", LLAMA, "--prompt-ids", "1", "--top-logprobs", "21"],
     "--top-logprobs must be an integer in [0, 20], got 21"),
    (["--model", LLAMA, "--prompt-ids", "1", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be"),
    (["--model", LLAMA, "--prompt-ids", "1", "--presence-penalty", "3"], "--presence-penalty must be in [-2, 2], got 3"),
    (["--model", LLAMA, "--prompt-ids", "1", "--frequency-penalty", "x"], "--frequency-penalty must be a number"),
    (["--model", LLAMA, "--prompt-ids", "1", "--repetition-penalty", "0"],
     "--repetition-penalty must be a finite number > 0"),
    (["--model", LLAMA, "--prompt-ids", "1", "--repetition-penalty", "-1"],
     "--repetition-penalty must be a finite number > 0 (1 = off), got -1"),
    (["--model", LLAMA, "--prompt-ids", "1", "--min-p", "2"], "--min-p must be in [0, 1]"),
    (["--model", LLAMA, "--prompt-ids", "1", "--page-size", "0"], "--page-size must be >= 1"),
    (["--model", LLAMA, "--prompt-ids", "1", "--temperature", "-1"],
     "--temperature must be a finite number >= 0"),
    (["--model", LLAMA, "--prompt-ids", "1", "--temperature", "nan"],
     "--temperature must be a finite number >= 0, got nan"),
    (["--model", LLAMA, "--prompt-ids", "1", "--dtype", "int8"], "invalid choice"),
    (["--model", LLAMA, "--prompt-ids", "1", "--interleave", "0"], "--interleave must be >= 1"),
    (["--model", LLAMA, "--prompt-ids", "1", "--bogus"], "unrecognized arguments: --bogus"),
    (["--model", LLAMA, "--prompt-ids", "1", "--logit-bias", "5"], "--logit-bias takes ID=BIAS"),
    (["--model", LLAMA, "--prompt-ids", "1", "--logit-bias", "5=101"], "with a bias in [-100, 100], got '5=101'"),
    (["--model", LLAMA, "--prompt-ids", "1", "--allowed-token-ids", "a"], "--allowed-token-ids takes comma-separated"),
    (["--model", LLAMA, "--prompt-ids", "1", "--min-tokens", "-1"],
     "--min-tokens must be an integer >= 0, got -1"),
    (["--model", LLAMA, "--prompt-ids", "1", "--n", "0"], "--n must be an integer >= 1"),
    (["--model", LLAMA, "--prompt-ids", "1", "--prompt-logprobs", "21"],
     "--prompt-logprobs must be an integer in [0, 20]"),
    (["--model", LLAMA, "--prompt-ids", "1", "--regex", "a", "--choice", "b"], "--choice: not allowed with"),
    (["--model", LLAMA, "--prompt-ids", "1", "--json-schema", "/no/schema.json"], "--json-schema takes JSON or a file"),
    (["--model", LLAMA, "--prompt-ids", "1", "--json-schema", "{oops"], "--json-schema is not valid JSON"),
    (["--model", LLAMA, "--prompt-ids", "1", "--seed", str(2**32)],
     "--seed must be an integer in [0, 2**32)"),
    (["--model", LLAMA, "--prompt-ids", "1", "--top-k", "2.5"],
     "--top-k must be an integer, got '2.5'"),
    (["--model", LLAMA, "--prompt-ids", "1", "--max-new-tokens", "0"],
     "--max-new-tokens must be an integer >= 1,"),
    # a rule between two flags is SamplingParams' (checked before the model loads)
    (["--model", LLAMA, "--prompt-ids", "1", "--max-new-tokens", "2", "--min-tokens", "3"],
     "min_tokens (3) must be at most max_tokens (2)"),
    (["--model", LLAMA, "--prompt-ids", "1", "--stop", ""],
     "stop takes at most 16 non-empty strings"),
    (["--model", LLAMA, "--prompt", ""], "--prompt is empty: give some text"),
    (["--model", LLAMA, "--prompt-ids", "1", "--max-model-len", "1"],
     "--max-model-len must be >= 2, got 1"),
    # a path given on the command line is checked before the model loads
    (["--model", LLAMA, "--prompt-ids", "1", "--save", CONFIG],
     f"--save {CONFIG!r} is a file, not a directory: give a directory"),
    (["--model", LLAMA, "--prompt-ids", "1", "--save", CONFIG + "/sub"],
     "config.json is a file, so no directory can be made under it"),
    (["--model", LLAMA, "--prompt-ids", "1", "--save", LLAMA], "holds a Hugging Face checkpoint"),
    (["--model", LLAMA, "--prompt-ids", "1", "--compilation-cache", CONFIG + "/sub"],
     f"--compilation-cache {CONFIG + '/sub'!r}: {CONFIG} is a file, so no directory"),
    *([(["--model", LLAMA, "--prompt-ids", "1", "--save", "/proc/nope"],
        "--save '/proc/nope': cannot make a directory in /proc (")]
      if sys.platform == "linux" else []),
    # --grammar: a one-line value without ':' (no rule) names a file
    (["--model", LLAMA, "--prompt-ids", "1", "--grammar", "no/grammar.lark"],
     "--grammar takes a grammar or a file of it; 'no/grammar.lark' has no rule (no ':') and cannot "
     "be read as a file (No such file or directory)"),
    # a structured output that cannot compile is the flag's error, its reason on one line
    (["--model", LLAMA, "--prompt-ids", "1", "--grammar", "start: ???"],
     "error: --grammar: the grammar grammar cannot be compiled: 1(8): Expected value"),
    (["--model", LLAMA, "--prompt-ids", "1", "--regex", "(("],
     "error: --regex: the regex grammar cannot be compiled: at 1(8): invalid regex \"((\" "
     "(in regex): regex parse error: (( error: unclosed group\n"),
    (["--model", LLAMA, "--prompt-ids", "1", "--json-schema", '{"type": "foo"}'],
     "error: --json-schema: the json grammar cannot be compiled: Invalid type: foo"),
]


@pytest.mark.parametrize("argv,message", USAGE)
def test_usage_errors(capsys, argv, message):
    code, out, err = cli(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert out == ""


RUNTIME = [
    (lambda d: None, ["--model", "/no/such/dir"], "does not exist"),
    (lambda d: None, ["--model", str(FIX / "llama-gqa" / "config.json")],
     "is neither a directory nor a GGUF file"),
    (lambda d: (d / "config.json").unlink(), [], "neither a Hugging Face checkpoint (no config.json)"),
    (lambda d: (d / "config.json").write_text("{not json"), [], "cannot read"),
    (_set_config(architectures=["GPT2LMHeadModel"]), [], "unsupported architecture ['GPT2LMHeadModel']"),
    (_set_config(rope_parameters={"rope_type": "longrope", "factor": 2.0}), [], "unsupported rope scaling 'longrope'"),
    (_set_config(hidden_size=None), [], "malformed field"),
    (lambda d: (d / "model.safetensors").unlink(), [], "no *.safetensors weights"),
    (_truncate, [], "truncated or corrupt"),
    (_set_config(hidden_size=32), [], "config.json implies"),
    (lambda d: None, ["--tp", "3"], "tp=3 does not divide the model's 8 attention heads"),
    (lambda d: None, ["--tp", "4", "--dcp", "4"], "mesh tp=4 x dcp=4: the mesh needs 16 devices but only 8 cpu "
     "device(s) exist: use a mesh of at most 8 devices, or simulate 16 CPU devices (JAX_PLATFORMS=cpu"),
    (lambda d: None, ["--max-seq-len", "3"], "the prompt has 3 tokens but the model context (max_model_len) is 3"),
    (lambda d: None, ["--kv-cache-memory", "100"], "a KV budget of 100 bytes per device holds 0 pages"),
    (lambda d: None, ["--kv-host-memory", "100"], "kv_host_memory 100 bytes holds no block"),
    (lambda d: None, ["--kv-host-memory", "1MiB", "--no-enable-prefix-caching"], "drop --no-enable-prefix-caching"),
    (lambda d: None, ["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization needs a GPU"),
    (lambda d: None, ["--page-size", "6", "--interleave", "4"], "page_size 6 must be a multiple of the interleave"),
    (lambda d: None, ["--prompt-ids", "3,999"], "token id 999 is outside the vocabulary [0, 256)"),
    (lambda d: None, ["--prompt", "hello"], "no tokenizer.json"),
    (lambda d: None, ["--regex", "a+"], "structured outputs need the model's tokenizer (tokenizer.json)"),
]


@pytest.mark.parametrize("edit,extra,message", RUNTIME)
def test_runtime_errors(capsys, tmp_path, edit, extra, message):
    d = _broken(tmp_path, edit)
    argv = ["--model", d, "--max-new-tokens", "2"] + extra
    if "--prompt" not in extra and "--prompt-ids" not in extra:
        argv += ["--prompt-ids", "1,2,3"]
    code, out, err = cli(capsys, *argv)
    assert code == 1, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


# a directory named by the environment, which is no command-line misuse: found as the model loads
ENVIRONMENT = [
    ({"DCP_JAX_CACHE_DIR": CONFIG}, [],
     f"error: DCP_JAX_CACHE_DIR={CONFIG}: cannot make the compilation cache directory (a file is "
     "there): set it to a directory you can write, or 'off'\n"),
    ({"DCP_JAX_MODEL_CACHE": CONFIG + "/sub"}, ["--model", "smollm2-135m-instruct"],
     f"error: DCP_JAX_MODEL_CACHE={CONFIG}/sub: cannot write the model cache there (a file is in "
     "the way): set it to a directory you can write\n"),
]


@pytest.mark.parametrize("env,extra,message", ENVIRONMENT)
def test_environment_errors(capsys, monkeypatch, env, extra, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", "1,2", "--max-new-tokens", "2",
                         *extra)
    assert (code, out, err) == (1, "", message)


# python -m dcp_jax.fetch: misuse is one line and 2, as generate's; a cache it cannot write, 1
# (argparse quotes the choices one way or the other by Python version: the line's head and tail)
FETCH = [
    ({}, ["bogus"], 2, "error: argument name: invalid choice: 'bogus' (choose from ",
     "smollm2-135m-instruct') (see --help)\n"),
    ({"DCP_JAX_MODEL_CACHE": CONFIG}, [], 1, f"error: DCP_JAX_MODEL_CACHE={CONFIG}: cannot write "
     "the model cache there (a file is in the way): set it to a directory you can write\n", ""),
]


@pytest.mark.parametrize("env,argv,status,head,tail", FETCH)
def test_fetch_errors(capsys, monkeypatch, env, argv, status, head, tail):
    from dcp_jax import fetch

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert fetch.main(argv) == status
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(head), err
    assert err.replace("'", "").endswith(tail.replace("'", "")), err


def _subprocess(*argv):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-m", "dcp_jax.generate", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


def test_fresh_process_simulates_its_devices():
    p = _subprocess("--model", LLAMA, "--mesh", "tp=2,dcp=4", "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                    "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["stats"]["dcp"] == 4


def test_fresh_process_error_has_no_traceback():
    p = _subprocess("--model", LLAMA, "--tp", "3", "--prompt-ids", "1")
    assert p.returncode == 1
    assert "Traceback" not in p.stderr and p.stderr.strip().splitlines()[-1].startswith("error: tp=3")


def test_one_bad_prompt_fails_alone(capsys):
    # A prompt that can never run fails with its own error line; the other prompt's output is printed.
    code, out, err = cli(capsys, "--model", LLAMA, "--prompt-ids", "1,2,3", "--prompt-ids", "4," * 40 + "5",
                         "--max-seq-len", "16", "--max-new-tokens", "2", "--json")
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("error: prompt 1: the prompt has 41 tokens"), err
    obj = json.loads(out)
    assert len(obj["tokens"][0]) == 2 and obj["tokens"][1] == []
