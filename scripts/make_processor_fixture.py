"""Reference tokens for logit_bias and allowed_token_ids from transformers' own logits processors.

Run by hand (NOT in CI; it needs torch and transformers), from the repository root:

    python scripts/make_processor_fixture.py        # writes tests/fixtures/llama-gqa/processors.json

For each prompt of the llama-gqa fixture (alone, greedy, EOS ignored, 8 new tokens):
  - logit_bias: `sequence_bias` with single-token sequences (transformers' SequenceBiasLogitsProcessor):
    -100 on the prompt's own first greedy token and +4 on token 7;
  - allowed_token_ids [7, 11, 19, 42]: `prefix_allowed_tokens_fn` (PrefixConstrainedLogitsProcessor).
The tests compare dcp_jax's greedy tokens under the same rules with these.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

FIX = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama-gqa"
ALLOWED = [7, 11, 19, 42]


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
        cases.append(dict(prompt=prompt, logit_bias=[[t, b] for t, b in bias.items()], biased=biased.tolist(),
                          allowed_token_ids=ALLOWED, allowed=allowed.tolist()))
    out = dict(transformers_version=transformers.__version__, torch_version=torch.__version__, cases=cases)
    (FIX / "processors.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {FIX / 'processors.json'}")


if __name__ == "__main__":
    main()
