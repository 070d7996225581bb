"""Reference tokens for logit_bias, allowed_token_ids, penalties, bad words and min_tokens from
transformers' own logits processors.

Run by hand (NOT in CI; it needs torch and transformers), from the repository root:

    python scripts/make_processor_fixture.py        # writes tests/fixtures/llama-gqa/processors.json

For each prompt of the llama-gqa fixture (alone, greedy, EOS ignored, 8 new tokens):
  - logit_bias: `sequence_bias` with single-token sequences (transformers' SequenceBiasLogitsProcessor):
    -100 on the prompt's own first greedy token and +4 on token 7;
  - allowed_token_ids [7, 11, 19, 42]: `prefix_allowed_tokens_fn` (PrefixConstrainedLogitsProcessor);
and, 12 new tokens:
  - repetition_penalty 1.8 (RepetitionPenaltyLogitsProcessor: prompt and output, as vLLM's);
  - presence 1.2 / frequency 0.9 penalties, and all three together: transformers has no processor for
    these two, so `OpenAIPenalties` below (OpenAI's and vLLM's formula over the output tokens, a few
    lines) runs inside `generate` after its repetition penalty, as vLLM orders them;
  - bad words (NoBadWordsLogitsProcessor): the prompt's first greedy token, and the 2nd and 3rd tokens
    of what it gives instead (a two-token word: its last token is banned after its first);
  - min_tokens 4 with logit_bias +100 on EOS (MinNewTokensLengthLogitsProcessor, SequenceBias): four
    tokens, then EOS, which stops.
The tests compare dcp_jax's greedy tokens under the same rules with these. And `prompt_scores`: for a
45-token prompt, transformers' log-softmax at every position, the log-probability of each next prompt
token and the 5 most likely (id, logprob) pairs (prompt logprobs and `echo`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

FIX = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama-gqa"
ALLOWED = [7, 11, 19, 42]
PENALTIES = [dict(repetition_penalty=1.8), dict(presence_penalty=1.2, frequency_penalty=0.9),
             dict(repetition_penalty=1.5, presence_penalty=0.6, frequency_penalty=0.8)]


class OpenAIPenalties(transformers.LogitsProcessor):
    """scores - frequency x count - presence x (count > 0), counts over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def main() -> None:
    exp = json.loads((FIX / "expected.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(FIX, dtype=torch.float32).eval()
    cases = []
    for prompt, greedy in zip(exp["prompts"], exp["greedy"]):
        ids = torch.tensor([prompt])
        # every prompt position is attended (an explicit mask: a prompt may hold the pad id); EOS may be
        # emitted and does not stop (min_new_tokens would ban it: dcp_jax's ignore_eos does not)
        kw = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0,
                  eos_token_id=None)
        bias = {greedy[0]: -100.0, 7: 4.0}
        with torch.no_grad():
            biased = model.generate(ids, sequence_bias={(t,): b for t, b in bias.items()}, **kw)[0, len(prompt):]
            allowed = model.generate(ids, prefix_allowed_tokens_fn=lambda batch, sent: ALLOWED, **kw)[0, len(prompt):]
        case = dict(prompt=prompt, logit_bias=[[t, b] for t, b in bias.items()], biased=biased.tolist(),
                    allowed_token_ids=ALLOWED, allowed=allowed.tolist(), penalties=[])
        kw12 = dict(kw, max_new_tokens=12)
        with torch.no_grad():
            case["greedy12"] = model.generate(ids, **kw12)[0, len(prompt):].tolist()
        for pen in PENALTIES:
            procs = transformers.LogitsProcessorList()
            if "presence_penalty" in pen:
                procs.append(OpenAIPenalties(len(prompt), pen["presence_penalty"], pen["frequency_penalty"]))
            with torch.no_grad():
                out = model.generate(ids, repetition_penalty=pen.get("repetition_penalty", 1.0), logits_processor=procs,
                                     **kw12)[0, len(prompt):]
            case["penalties"].append(dict(params=pen, tokens=out.tolist()))
        with torch.no_grad():
            alt = model.generate(ids, bad_words_ids=[[greedy[0]]], **kw12)[0, len(prompt):].tolist()
            words = [[greedy[0]], alt[1:3]]
            # transformers also matches a word's first tokens against the prompt's end (vLLM: the output's)
            assert prompt[-1] != words[1][0]
            banned = model.generate(ids, bad_words_ids=words, **kw12)[0, len(prompt):]
            eos = model.generation_config.eos_token_id
            eos = eos[0] if isinstance(eos, list) else eos
            early = model.generate(ids, min_new_tokens=4, sequence_bias={(eos,): 100.0},
                                   **dict(kw12, eos_token_id=eos))[0, len(prompt):]
        case.update(bad_words=words, banned=banned.tolist(), eos=eos, min_tokens=4, min_tokens_tokens=early.tolist())
        cases.append(case)
    prompt = [int(t) for t in torch.randint(3, 250, (45,), generator=torch.Generator().manual_seed(7))]
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    top = torch.topk(lsm, 5, dim=-1)
    scores = dict(prompt=prompt, logprobs=[None] + [lsm[i - 1, prompt[i]].item() for i in range(1, len(prompt))],
                  top=[None] + [[[int(a), float(b)] for a, b in zip(top.indices[i - 1], top.values[i - 1])]
                                for i in range(1, len(prompt))])
    out = dict(transformers_version=transformers.__version__, torch_version=torch.__version__, cases=cases,
               prompt_scores=scores)
    (FIX / "processors.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {FIX / 'processors.json'}")


if __name__ == "__main__":
    main()
