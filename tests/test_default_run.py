"""`python -m dcp_jax.generate` with no arguments: the embedded trained model on tp=2 x dcp=4."""

import re
import subprocess
import sys

from dcp_jax.generate import DEFAULT_MODEL


def test_default_run_prints_readable_text_and_report():
    assert DEFAULT_MODEL.is_dir(), "the trained tiny model ships inside the package"
    p = subprocess.run([sys.executable, "-m", "dcp_jax.generate"], capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-2000:]
    out = p.stdout
    text = out.split("\nmodel       ")[0].split("\n", 2)[-1]  # after the prompt line: the generated text
    assert len(text) > 100
    printable = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text) / len(text)
    assert printable > 0.95, text
    words = re.findall(r"[A-Za-z]+", text)
    common = {"the", "of", "is", "a", "to", "and", "in", "be", "for", "an", "that", "this", "are", "or"}
    assert sum(w.lower() in common for w in words) >= 5, text  # English, not random bytes
    assert "mesh        tp=2 x dcp=4 (8 devices)" in out
    assert "TP alone on 8 devices would hold" in out and "TTFT" in out and "decode" in out
    assert "orbax checkpoint" in out
    assert "Traceback" not in p.stderr
