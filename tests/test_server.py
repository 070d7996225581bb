"""The OpenAI-compatible server, end to end: a real uvicorn server on a loopback port, driven by the
official `openai` client (and httpx for what that client will not send), on the llama-tokenizer fixture
over a (tp=1, dcp=2) mesh."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from dcp_jax import LLM, UserError
from dcp_jax.serving.request import resolve_bad_words
from tests.util import FIXTURES, TEMPLATE, templated_checkpoint

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny-llama"
MAX_MODEL_LEN = 128
# 16 prompts of 9..16 tokens: with max_tokens 8 they share one compiled configuration in LLM.generate
PROMPTS = [[(7 * i + 3 * j) % 250 + 2 for j in range(9 + i % 8)] for i in range(16)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dcp_jax.launch import make_app, serve_in_thread

    ckpt = templated_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")
    sizes = dict(max_num_seqs=8, max_model_len=MAX_MODEL_LEN, page_size=8, prefill_chunk=32, decode_steps=2)
    app, served = make_app(ckpt, tp=1, dcp=2, served_model_name=MODEL, **sizes)  # 2: streams come in several chunks
    # the references: each prompt alone through LLM.generate, on a second LLM over the same model (the
    # served one's engine belongs to the server's thread)
    llm = LLM(served.model, served.mesh, served.tokenizer, **sizes)
    alone = [llm.generate([p], max_new_tokens=8).text[0] for p in PROMPTS]

    base, stop = serve_in_thread(app, timeout_s=30)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=60, max_retries=0)
    yield dict(base=base, client=client, llm=llm, served=served, alone=alone, ckpt=ckpt,
               alone_text=lambda prompt: llm.generate([prompt], max_new_tokens=8).text[0])
    stop()  # raises if the server thread does not end


def metrics(base) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(dcp_jax:[a-z0-9_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_models_and_health(server):
    assert [m.id for m in server["client"].models.list().data] == [MODEL]
    assert server["client"].models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):  # OpenAI's and vLLM's answer to an unknown model
        server["client"].models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError):
        server["client"].completions.create(model="x" * 10_000, prompt="hi", max_tokens=1)
    assert httpx.get(server["base"] + "/health").json() == {"status": "ok"}
    with pytest.raises(UserError, match="engine is in use"):  # the server's thread drives it
        server["served"].generate([[1, 2, 3]], max_new_tokens=2)


def test_out_of_range_values_are_refused_and_the_server_goes_on(server):
    # top_k past int32 used to overflow inside the engine thread and stop the server for good.
    c = server["client"]
    for extra, param in (('"top_k": 1000000000000', "top_k"), ('"top_k": 2147483648, "temperature": 0', "top_k"),
                         ('"top_k": -1', "top_k"), ('"temperature": Infinity', "temperature"),
                         ('"seed": 4294967296', "seed")):
        body = '{"model": "%s", "prompt": "Hello", "max_tokens": 2, %s}' % (MODEL, extra)
        r = httpx.post(server["base"] + "/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0)
    assert r.choices[0].text == server["alone_text"]("Hello world")
    assert httpx.get(server["base"] + "/health").status_code == 200


def test_a_step_that_raises_fails_its_request_and_the_server_goes_on(server):
    # A failure inside the engine thread (here: the decode program raising after it took the pools)
    # fails that step's request with a retryable 503; the pool is rebuilt and the next request is served.
    engine = server["served"].engine
    real = engine.runner.step_program
    calls = []

    def failing():
        program = real()

        def run(*args):
            calls.append(1)
            engine.runner.step_program = real  # once
            program(*args)  # donates (deletes) the pools...
            raise RuntimeError("injected device failure")  # ...then fails
        return run

    engine.runner.step_program = failing
    with pytest.raises(openai.APIStatusError) as e:
        server["client"].completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0)
    assert e.value.status_code == 503 and "injected device failure" in e.value.message and calls == [1]
    r = server["client"].completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0)
    assert r.choices[0].text == server["alone_text"]("Hello world")
    assert httpx.get(server["base"] + "/health").status_code == 200
    m = metrics(server["base"])
    assert m["dcp_jax:kv_pages_used"] == 0 and m["dcp_jax:num_requests_running"] == 0
    assert engine.stats()["pool_resets"] >= 1


def test_tokenize_and_detokenize_as_vllm_answers(server):
    # vLLM's request and response shapes; a chat's token count equals the prompt tokens a chat completion
    # of the same messages reports
    base, llm, c = server["base"], server["llm"], server["client"]
    ids = llm.encode("Hello world")
    r = httpx.post(base + "/tokenize", json=dict(model=MODEL, prompt="Hello world"), timeout=30).json()
    assert r == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    r = httpx.post(base + "/tokenize", json=dict(prompt="Hello world", return_token_strs=True), timeout=30).json()
    assert r["tokens"] == ids and len(r["token_strs"]) == len(ids) and all(isinstance(t, str) for t in r["token_strs"])
    messages = [{"role": "user", "content": "Hi there"}]
    r = httpx.post(base + "/tokenize", json=dict(model=MODEL, messages=messages), timeout=30).json()
    usage = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0).usage
    assert r["count"] == usage.prompt_tokens == len(r["tokens"])
    bare = httpx.post(base + "/tokenize", json=dict(messages=messages, add_generation_prompt=False), timeout=30).json()
    assert bare["count"] < r["count"]  # without "<assistant>"
    d = httpx.post(base + "/detokenize", json=dict(model=MODEL, tokens=ids), timeout=30).json()
    assert d == {"prompt": llm.decode(ids)}
    # /tokenizer_info, as lm-eval's remote tokenizer reads it (the EOS token's text encodes to its id)
    info = httpx.get(base + "/tokenizer_info", timeout=30).json()
    assert info["model_max_length"] == MAX_MODEL_LEN and info["chat_template"] == TEMPLATE
    eos = llm.model.config.eos_token_ids[0]
    assert httpx.post(base + "/tokenize", json=dict(prompt=info["eos_token"], add_special_tokens=False),
                      timeout=30).json()["tokens"] == [eos]
    for path, body, status, text in [
        ("/tokenize", dict(prompt="a", messages=messages), 400, "either prompt or messages"),
        ("/tokenize", dict(), 400, "either prompt or messages"),
        ("/tokenize", dict(model="other", prompt="a"), 404, "does not exist"),
        ("/tokenize", dict(prompt=5), 400, "prompt"),
        ("/detokenize", dict(tokens=[1, 10**6]), 400, "token id 1000000 is outside the vocabulary"),
        ("/detokenize", dict(tokens="1,2"), 400, "tokens"),
    ]:
        resp = httpx.post(base + path, json=body, timeout=30)
        assert resp.status_code == status and text in resp.json()["error"]["message"], (path, body, resp.text)


def test_completion_usage_logprobs_and_stream(server):
    c, llm = server["client"], server["llm"]
    prompt = "Hello world"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=1)
    choice = r.choices[0]
    n = len(choice.logprobs.tokens)
    assert r.usage.prompt_tokens == len(llm.encode(prompt))
    assert r.usage.completion_tokens == n and r.usage.total_tokens == r.usage.prompt_tokens + n
    assert choice.finish_reason in ("stop", "length") and (n == 8) == (choice.finish_reason == "length")
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs) and len(choice.logprobs.token_logprobs) == n
    # greedy is what LLM.generate gives
    assert choice.text == llm.generate([prompt], max_new_tokens=8).text[0]

    chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    # a prompt as token ids (and as a list of one) gives the same tokens
    ids = llm.encode(prompt)
    for p in (ids, [ids], [prompt]):
        assert c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text == choice.text


def test_top_logprobs(server):
    # completions logprobs=N and chat top_logprobs=N: each token's N most likely alternatives, most likely
    # first, from the logits it was sampled from (greedy: the first is the token itself); streamed the same
    c, llm = server["client"], server["llm"]
    want = llm.generate(["Hello world"], max_new_tokens=6, top_logprobs=3)
    r = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == len(want.tokens[0])
    for tok, chosen, alts, ref in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, want.top_logprobs[0]):
        assert len(alts) <= 3 and list(alts.values()) == sorted(alts.values(), reverse=True)
        assert alts[tok] == pytest.approx(chosen) and max(alts.values()) == pytest.approx(chosen)
        assert sorted(alts.values(), reverse=True)[0] == pytest.approx(ref[0][1], abs=1e-6)
    streamed = [a for ch in c.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0,
                                                 logprobs=3, stream=True)
                if ch.choices[0].logprobs for a in ch.choices[0].logprobs.top_logprobs]
    assert streamed == lp.top_logprobs
    messages = [{"role": "user", "content": "Hi there"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=2)
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].bytes == entry.bytes
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_logit_bias_min_p_and_allowed_token_ids(server):
    # the same rules as LLM.generate's: a bias of -100 on the greedy first token gives the second best;
    # allowed_token_ids confines every token; min_p keeps a sampled token within min_p of the best
    c, llm = server["client"], server["llm"]
    ids = llm.encode("Hello world")
    plain = llm.generate([ids], max_new_tokens=4, top_logprobs=2)
    first, second = (t for t, _ in plain.top_logprobs[0][0])
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logprobs=0,
                             logit_bias={str(first): -100})
    want = llm.generate([ids], max_new_tokens=4, logit_bias={first: -100})
    assert r.choices[0].text == want.text[0] and want.tokens[0][0] == second
    allowed = [second, 40, 41]
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.9, seed=3,
                             extra_body=dict(allowed_token_ids=allowed, ignore_eos=True))
    assert r.choices[0].text == llm.generate([ids], max_new_tokens=6, temperature=0.9, seed=3, ignore_eos=True,
                                             allowed_token_ids=allowed).text[0]
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=1.0, seed=5, logprobs=20,
                             extra_body=dict(min_p=0.3, ignore_eos=True))
    for chosen, alts in zip(r.choices[0].logprobs.token_logprobs, r.choices[0].logprobs.top_logprobs):
        assert chosen >= max(alts.values()) + np.log(0.3) - 1e-5


def test_penalties_and_bad_words(server):
    # OpenAI's presence/frequency penalties and vLLM's repetition_penalty and bad_words: the tokens
    # LLM.generate gives with the same values (bad words tokenized by the same rule); a banned word
    # never appears
    c, llm = server["client"], server["llm"]
    ids = llm.encode("the the the the the the")  # (a prompt whose tokens the tiny model repeats)
    pen = dict(presence_penalty=0.7, frequency_penalty=1.1)
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0, **pen,
                             extra_body=dict(repetition_penalty=1.6, ignore_eos=True))
    want = llm.generate([ids], max_new_tokens=16, ignore_eos=True, repetition_penalty=1.6, **pen)
    assert r.choices[0].text == want.text[0] and want.tokens[0] != llm.generate([ids], max_new_tokens=16,
                                                                                ignore_eos=True).tokens[0]
    word = llm.decode(want.tokens[0][:2])
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                  temperature=0.8, seed=4, extra_body=dict(bad_words=[word], ignore_eos=True))
    assert r.choices[0].finish_reason == "length"
    banned = resolve_bad_words([word], llm.encode_words)  # (as the server's intake does)
    assert banned and not any(tuple(out[i:i + len(w)]) == w for w in banned for out in [
        llm.encode(r.choices[0].message.content)] for i in range(len(out)))


def test_echo_and_prompt_logprobs(server):
    # echo (what lm-eval's loglikelihood sends): the prompt's text and tokens before the completion's,
    # the first token with no logprob, the others scored as LLM.generate(prompt_logprobs=N) scores them;
    # max_tokens 0 scores the prompt alone; vLLM's prompt_logprobs: per token a dict with its rank
    c, llm = server["client"], server["llm"]
    ids = llm.encode("the cat sat on the mat")
    ref = llm.generate([ids], max_new_tokens=3, ignore_eos=True, prompt_logprobs=2)
    r = c.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=2,
                             extra_body=dict(ignore_eos=True))
    lp = r.choices[0].logprobs
    prompt_text = llm.decode(ids)
    assert r.choices[0].text == prompt_text + ref.text[0]
    assert lp.tokens[:len(ids)] == [llm.decode([t]) for t in ids] and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], ref.prompt_logprobs[0][1:], atol=1e-6)
    np.testing.assert_allclose(lp.token_logprobs[len(ids):], ref.logprobs[0], atol=1e-6)
    assert [list(d) for d in lp.top_logprobs[1:len(ids)]] == [
        [llm.decode([i]) for i, _ in alts] for alts in ref.prompt_top_logprobs[0][1:]]
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    zero = c.completions.create(model=MODEL, prompt="the cat sat on the mat", max_tokens=0, echo=True, logprobs=1)
    assert zero.choices[0].text == "the cat sat on the mat" and zero.usage.completion_tokens == 0
    assert len(zero.choices[0].logprobs.tokens) == len(ids)
    np.testing.assert_allclose(zero.choices[0].logprobs.token_logprobs[1:], ref.prompt_logprobs[0][1:], atol=1e-6)
    streamed = list(c.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                         logprobs=0, stream=True, extra_body=dict(ignore_eos=True)))
    assert "".join(ch.choices[0].text for ch in streamed) == prompt_text + ref.text[0]
    assert streamed[0].choices[0].logprobs.token_logprobs[0] is None
    vllm = httpx.post(server["base"] + "/v1/completions", timeout=30, json=dict(
        model=MODEL, prompt=ids, max_tokens=1, prompt_logprobs=2)).json()["choices"][0]["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for tok, entry, lp_ref in zip(ids[1:], vllm[1:], ref.prompt_logprobs[0][1:]):
        assert abs(entry[str(tok)]["logprob"] - lp_ref) < 1e-6
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and len(entry) in (2, 3)
    chat = httpx.post(server["base"] + "/v1/chat/completions", timeout=30, json=dict(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, prompt_logprobs=0)).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_structured_outputs(server):
    # OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs / guided_*: the
    # outputs of the random-weight model parse and validate; a schema llguidance cannot compile is a 400
    # naming it; two structured fields at once are refused
    import jsonschema

    c = server["client"]
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
              "w": {"enum": ["a", "b"]}}, "required": ["n", "w"], "additionalProperties": False}
    messages = [{"role": "user", "content": "give me json"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0.8, seed=2, n=3,
                                  response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0,
                             extra_body=dict(structured_outputs={"regex": "[a-f]{4}-[0-9]{2}"}))
    assert re.fullmatch("[a-f]{4}-[0-9]{2}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=1.0, seed=1, stream=True,
                             extra_body=dict(guided_choice=["alpha", "beta"]))
    assert "".join(ch.choices[0].text for ch in r) in ("alpha", "beta")
    for body, param, text in [
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}), None,
         "the json grammar cannot be compiled: Invalid type: wat"),
        (dict(response_format={"type": "yaml"}), "response_format", "response_format type must be"),
        (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs", "exactly one of"),
        (dict(guided_regex="a", response_format={"type": "json_object"}), "guided_regex", "give one structured output"),
    ]:
        bad = httpx.post(server["base"] + "/v1/completions", timeout=30,
                         json=dict(model=MODEL, prompt="hi", max_tokens=4, **body))
        assert bad.status_code == 400 and text in bad.json()["error"]["message"], bad.text
        assert bad.json()["error"]["param"] == param


def test_structured_outputs_on_the_default_model():
    # the embedded byte-level model (no --model): a json_schema response_format is served
    # (llguidance gets its byte vocabulary) and each choice, ended where its grammar completes,
    # validates
    import jsonschema

    from dcp_jax.launch import make_app, serve_in_thread

    app, _ = make_app(tp=1, dcp=2, max_num_seqs=4, page_size=8, prefill_chunk=32)
    base, stop = serve_in_thread(app, timeout_s=30)
    try:
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                  "n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "n"],
                  "additionalProperties": False}
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        r = httpx.post(base + "/v1/completions", timeout=60, json=dict(
            model="dcp-jax-tiny", prompt="def f(x):", max_tokens=60, temperature=0.8, seed=3, n=3,
            response_format=fmt))
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 3
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["text"]), schema)
    finally:
        stop()


def test_n_samples(server):
    # n seeded samples: choice j is what seed + j gives alone; streamed choices (interleaved chunks, each
    # with its index) equal the whole response's; usage counts the prompt once and every sample's tokens
    c, llm = server["client"], server["llm"]
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0.9, seed=5)
    r = c.completions.create(n=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    want = [llm.generate(["Hello world"], max_new_tokens=6, temperature=0.9, seed=5 + j).text[0] for j in range(3)]
    assert [ch.text for ch in r.choices] == want and len(set(want)) > 1
    lengths = [len(llm.generate(["Hello world"], max_new_tokens=6, temperature=0.9, seed=5 + j).tokens[0])
               for j in range(3)]
    assert r.usage.completion_tokens == sum(lengths)
    assert r.usage.prompt_tokens == len(llm.encode("Hello world"))
    texts = ["", "", ""]
    for ch in c.completions.create(n=3, stream=True, **kw):
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == want
    messages = [{"role": "user", "content": "Hi there"}]
    chat = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.9, seed=2, n=2)
    streamed = ["", ""]
    for ch in c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0.9, seed=2, n=2,
                                        stream=True):
        for choice in ch.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [ch.message.content for ch in chat.choices]


def test_stop_string_cuts_streamed_and_whole_text(server):
    c = server["client"]
    full = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0).choices[0].text
    stop = full[3:5]
    assert stop.strip()
    r = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text


def test_chat(server):
    c, llm = server["client"], server["llm"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True)
    rendered = "<s><system>Be brief.\n<user>Hi there\n<assistant>"
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert r.usage.prompt_tokens == len(ids)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == llm.generate([ids], max_new_tokens=6).text[0]
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == msg.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_cached_tokens_are_the_prefix_cache_hits(server):
    # a long prompt asked again: usage.prompt_tokens_details.cached_tokens is the prefix cache's hit
    # count for it (its whole blocks of 16 tokens before its last token), in completions, chat and
    # the final streamed usage chunk; the first time, whatever the cache held of it (here nothing)
    c, kv = server["client"], server["served"].engine.scheduler.kv
    words = np.random.default_rng(48).choice(["cache", "block", "page", "token", "prefix"], 22)
    text = " ".join(words)
    block = 16  # page_size 8 x dcp 2

    def ask(create, **kw):
        """(cached_tokens, the cache's hits while it ran, prompt tokens)."""
        before = kv.prefix_hit_tokens  # (counted when it is admitted: before its first token)
        if kw.get("stream"):
            chunks = list(create(stream_options={"include_usage": True}, **kw))
            assert chunks[-1].choices == []
            usage = chunks[-1].usage
        else:
            usage = create(**kw).usage
        return usage.prompt_tokens_details.cached_tokens, kv.prefix_hit_tokens - before, \
            usage.prompt_tokens

    kw = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    chat = dict(kw, messages=[{"role": "user", "content": text}])
    for create, body in ((c.completions.create, dict(kw, prompt=text)),
                         (c.chat.completions.create, chat)):
        cached, hits, n = ask(create, **body)
        assert cached == hits == 0 and 48 < n < MAX_MODEL_LEN - 8, (cached, hits, n)
        for stream in (False, True):
            cached, hits, n = ask(create, stream=stream, **body)
            assert cached == hits == (n - 1) // block * block > 0, (stream, cached, hits, n)


def test_concurrent_clients_match_generate_alone(server):
    c = server["client"]

    def one(i):
        return c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=8, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    assert got == server["alone"]


BAD = [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    ({"prompt": "hi"}, "model"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": 5}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "gpt-4", "prompt": "hi"}, "model", 404),  # OpenAI's and vLLM's model_not_found
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ({"model": MODEL, "prompt": list(range(2, 2 + MAX_MODEL_LEN - 4)), "max_tokens": 5}, "max_tokens"),
    ({"model": MODEL, "prompt": list(range(2, 2 + MAX_MODEL_LEN))}, "prompt"),
    ({"model": MODEL, "prompt": [300]}, None),  # outside the vocabulary: the scheduler refuses it
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "hi", "n": 17}, "n"),
    ({"model": MODEL, "prompt": "hi", "best_of": 3}, "best_of"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_k": -1}, "top_k"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "logprobs": -1}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "stop": 3}, "stop"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    # valid JSON that used to be a 500: a lone surrogate, nesting too deep for the parser
    (b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode(), "invalid_unicode"),
    (b'{"model": "%s", "prompt": "hi", "x": %s%s}' % (MODEL.encode(), b"[" * 100_000, b"]" * 100_000), "invalid_json"),
    # accepted before, now refused: an empty stop string, a stream_options flag that is not a bool
    ({"model": MODEL, "prompt": "hi", "stop": ""}, "stop"),
    ({"model": MODEL, "prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ({"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    # out of range: the penalties, bad words
    ({"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": MODEL, "prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ({"model": MODEL, "prompt": "hi", "bad_words": [""]}, "bad_words"),
    ({"model": MODEL, "prompt": "hi", "bad_words": [f"w{i}" for i in range(40)]}, "bad_words"),
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),  # (0 only with echo)
    # vLLM's extensions this server does not implement: refused by name
    ({"model": MODEL, "prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"300": 1}}, None),  # outside the vocabulary
    ({"model": MODEL, "prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"model": MODEL, "prompt": "hi", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
]


@pytest.mark.parametrize("case", BAD, ids=range(len(BAD)))
def test_bad_completion_requests(server, case):
    body, param, status = (*case, 400)[:3]
    kw = dict(content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) else dict(json=body)
    r = httpx.post(server["base"] + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and "Traceback" not in r.text
    if param in ("invalid_json", "invalid_unicode"):
        assert err["code"] == param
    elif param is not None:
        assert err["param"] == param, err
    # the server keeps serving
    ok = httpx.post(server["base"] + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                    timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, "messages"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, "functions"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),  # (completions' only)
])
def test_bad_chat_requests(server, body, param):
    r = httpx.post(server["base"] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_no_chat_template_and_full_queue(server):
    """A second app over its own (never compiled) engine: no chat template, and a queue of zero."""
    from fastapi.testclient import TestClient

    from dcp_jax.serving.async_engine import AsyncEngine
    from dcp_jax.server.app import create_app
    from dcp_jax.weights import chat_template_of

    assert chat_template_of(FIXTURES / "llama-tokenizer") is None
    llm = server["llm"]
    engine = llm.engine_with(prefill_chunk=16, max_num_seqs=2)
    app = create_app(AsyncEngine(engine, max_pending=0), model_name=MODEL, max_model_len=MAX_MODEL_LEN,
                     tokenizer=llm.tokenizer)
    with TestClient(app) as tc:
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
        assert 'dcp_jax:requests_total{status="503"} 1.0' in tc.get("/metrics").text


def test_load_with_disconnects_frees_everything(server):
    c, base = server["client"], server["base"]
    t_end = time.monotonic() + 45
    errors, done = [], []

    def one(i):
        if time.monotonic() > t_end:
            return
        try:
            prompt = PROMPTS[i % 16]
            if i % 5 == 0:  # disconnect after the first chunk
                stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True, seed=i)
                next(iter(stream))
                stream.close()
            elif i % 7 == 1:  # a non-streaming client that gives up before the answer
                with pytest.raises(httpx.TimeoutException):
                    httpx.post(base + "/v1/completions", json=dict(model=MODEL, prompt=prompt, max_tokens=100,
                                                                   ignore_eos=True), timeout=0.05)
            elif i % 2:
                chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True, seed=i))
                assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            else:
                r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.8, top_p=0.9,
                                         seed=i, extra_body={"top_k": 20})
                assert 1 <= r.usage.completion_tokens <= 8
            done.append(i)
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(f"{i}: {e!r}")

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(60)))
    assert not errors, errors
    assert len(done) == 60
    deadline = time.monotonic() + 10  # cancellations of the disconnected go through the engine thread
    while True:
        m = metrics(base)
        if (m["dcp_jax:kv_pages_used"], m["dcp_jax:num_requests_running"], m["dcp_jax:num_requests_waiting"]) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert m["dcp_jax:kv_pages_total"] > 0 and m["dcp_jax:kv_capacity_tokens"] > 0
    assert m["dcp_jax:tp"] == 1 and m["dcp_jax:dcp"] == 2
    assert m['dcp_jax:requests_total{status="200"}'] >= 60
    assert m["dcp_jax:generation_tokens_total"] > 0 and m["dcp_jax:prompt_tokens_total"] > 0
    assert m["dcp_jax:time_to_first_token_seconds_count"] > 0
    assert m["dcp_jax:time_per_output_token_seconds_count"] > 0
    # vLLM's names (prefix dcp_jax: for vllm:), for the dashboards people already have
    assert m["dcp_jax:inter_token_latency_seconds_count"] >= m["dcp_jax:time_per_output_token_seconds_count"]
    assert m["dcp_jax:e2e_request_latency_seconds_count"] >= m["dcp_jax:time_to_first_token_seconds_count"]
    assert m["dcp_jax:prefix_cache_queries_total"] >= m["dcp_jax:prompt_tokens_total"] > 0
    assert 0 <= m["dcp_jax:kv_cache_usage_perc"] <= 1 and "dcp_jax:prefix_cache_hits_total" in m
    assert m['dcp_jax:requests_finished_total{reason="abort"}'] >= 1  # some disconnects came mid-stream


def test_abandoned_non_streaming_request_is_cancelled(server):
    # A client that disconnects from a non-streaming request cancels it: nothing is generated for nobody.
    base = server["base"]
    before = metrics(base).get('dcp_jax:requests_finished_total{reason="abort"}', 0)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/v1/completions", json=dict(model=MODEL, prompt="Hello", max_tokens=120, ignore_eos=True),
                   timeout=0.05)
    deadline = time.monotonic() + 10
    while metrics(base).get('dcp_jax:requests_finished_total{reason="abort"}', 0) <= before:
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.1)
    m = metrics(base)
    assert m["dcp_jax:kv_pages_used"] == 0 and m["dcp_jax:num_requests_running"] == 0
    r = server["client"].completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0)
    assert r.choices[0].text == server["alone_text"]("Hello world")


def test_a_large_body_never_stalls_running_streams(server):
    # A 5 MB prompt is read, parsed and refused (it cannot fit the context) off the event loop: a
    # stream that runs meanwhile never waits half a second between chunks.
    base, gaps, started = server["base"], [], concurrent.futures.Future()

    def stream():
        last = None
        with httpx.stream("POST", base + "/v1/completions", timeout=60, json=dict(
                model=MODEL, prompt="Hello", max_tokens=110, ignore_eos=True, stream=True)) as r:
            for line in r.iter_lines():
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if not started.done():
                    started.set_result(now)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        f = pool.submit(stream)
        started.result(timeout=30)
        big = httpx.post(base + "/v1/completions", timeout=60,
                         json=dict(model=MODEL, prompt="x" * 5_000_000, max_tokens=2))
        f.result(timeout=60)
    assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded", big.text
    assert len(gaps) > 10 and max(gaps) < 0.5, max(gaps)


def test_streamed_logprob_offsets_run_on_and_token_bytes(server):
    c = server["client"]
    whole = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0, logprobs=1)
    offsets = [o for ch in c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0,
                                                logprobs=1, stream=True) if ch.choices[0].logprobs
               for o in ch.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    assert offsets == list(itertools.accumulate([len(t) for t in whole.choices[0].logprobs.tokens[:-1]], initial=0))


def test_token_bytes_are_the_tokens_own():
    # A byte-level BPE token holding part of a UTF-8 character has its own bytes, not U+FFFD's.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dcp_jax.server.protocol import TokenBytes
    from dcp_jax.weights import ByteTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["plain ascii words"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    text = "a☃b"
    ids = tok.encode(text).ids
    tb = TokenBytes(tok)
    got = [tb(i, tok.decode([i])) for i in ids]
    assert sum(got, []) == list(text.encode()) and any(tok.decode([i]).endswith("\ufffd") for i in ids)
    assert TokenBytes(ByteTokenizer())(0xE2, "\ufffd") == [0xE2]


def test_skip_special_tokens_false_keeps_them(server):
    # The request's text is decoded with skip_special_tokens as it asks (a detokenizer that says which
    # way it was called: this fails if the flag is dropped anywhere between the body and the text)...
    from dcp_jax.serving.request import Request

    seen = lambda ids, skip_special_tokens=True: f"skip={skip_special_tokens}"  # noqa: E731
    for flag in (True, False):
        r = Request("s", [5, 6, 7], max_tokens=1, skip_special_tokens=flag)
        r.append_token(9, 0.0, max_model_len=64, detokenize=seen)
        assert r.text == f"skip={flag}"
    # ...and through the server, the text of the same tokens decoded with the special tokens kept
    llm = server["llm"]
    body = dict(model=MODEL, prompt=[5, 6, 7], max_tokens=6, temperature=0, ignore_eos=True)
    kept = httpx.post(server["base"] + "/v1/completions", json=dict(body, skip_special_tokens=False),
                      timeout=30).json()
    tokens = llm.generate([[5, 6, 7]], max_new_tokens=6, ignore_eos=True).tokens[0]
    assert kept["choices"][0]["text"] == llm.tokenizer.decode(tokens, skip_special_tokens=False)


def test_vllm_extensions(server):
    c, llm = server["client"], server["llm"]
    base = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0)
    ids = llm.generate(["Hello world"], max_new_tokens=8).tokens[0]
    # stop_token_ids: the output ends at the first of them
    stop_id = ids[2]
    r = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0,
                             extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 3
    # include_stop_str_in_output keeps the stop string in the text
    word = base.choices[0].text[2:4]
    cut = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0, stop=[word])
    kept = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0, stop=[word],
                                extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + word
    # min_tokens: no stop before it (the stop id is held back on the device, so greedy takes another)
    m = c.completions.create(model=MODEL, prompt="Hello world", max_tokens=8, temperature=0,
                             extra_body={"stop_token_ids": [stop_id], "min_tokens": 6})
    assert m.usage.completion_tokens >= 6


@pytest.mark.parametrize("argv,needle", [
    (["--port", "x"], "--port"),
    (["--mesh", "tp=2"], "--mesh"),
    (["--mesh", "tp=1,dcp=2", "--tp", "2"], "not both"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--bogus"], "unrecognized"),
])
def test_cli_usage_errors(argv, needle):
    p = subprocess.run([sys.executable, "-m", "dcp_jax.serve", *argv], capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], p.stderr


def test_seeded_sampling_repeats(server):
    c = server["client"]
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=8, temperature=1.0, seed=1234, extra_body={"top_k": 50})
    a, b = (c.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b


def test_cli_missing_model_is_a_runtime_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "dcp_jax.serve", "--model", str(tmp_path / "nowhere"), "--port", "0"],
                       capture_output=True, text=True, timeout=120, check=False)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
