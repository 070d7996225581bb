"""`python -m dcp_jax.generate` with no arguments: the embedded trained model on tp=2 x dcp=4."""

import re
import subprocess
import sys

from dcp_jax.generate import DEFAULT_MODEL, DEFAULT_PROMPT


def test_default_run_prints_readable_text_and_report():
    assert DEFAULT_MODEL.is_dir(), "the trained tiny model ships inside the package"
    p = subprocess.run([sys.executable, "-m", "dcp_jax.generate"], capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    streamed = out.split("\nmodel       ")[0]
    prompt = DEFAULT_PROMPT.read_text()
    assert prompt in streamed
    text = streamed.split(prompt, 1)[1]  # what the model wrote
    assert len(text) > 60
    printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text) / len(text)
    assert printable > 0.95, text
    words = re.findall(r"[A-Za-z]+", text)
    common = {"the", "of", "is", "a", "to", "and", "in", "be", "for", "an", "that", "this", "are", "or", "if", "it",
              "as", "by", "with", "not", "on", "if", "only", "module", "object", "class"}
    assert sum(w.lower() in common for w in words) >= 3, text  # English, not random bytes
    assert len(words) >= 8 and sum(len(w) for w in words) / len(words) > 2.5, text
    assert "mesh        tp=2 x dcp=4 (8 devices)" in out
    assert "TP alone on 8 devices would hold" in out and "TTFT" in out and "decode" in out
    assert "orbax checkpoint" in out
    assert "Traceback" not in p.stderr
