#!/usr/bin/env bash
# One prepared, time-bounded check on a machine with one NVIDIA GPU (about 8 minutes): the device copy
# ceiling, the Pallas decode kernel against the jnp reference and cuDNN at 8K-128K keys, a 1.1B Llama
# end to end against transformers at 32K context, the prefill chunk sweep, the prefill kernel against
# cuDNN, and the kernel tests compiled for the GPU. See scripts/gpu_check.py for the stages.
#
#   bash scripts/gpu_check.sh [--quick] [--stages copy,decode_kernel,...]     # from anywhere
#
# Uses python3's own jax when it already sees a GPU (no package registry needed); otherwise makes
# .venv-gpu with the cuda extra. Results: JSON in $OUT/gpu_check.json when $OUT is set (else printed),
# then a markdown table of the headline figures, printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # transformers (torch) shares the GPU in the e2e stage
TOTAL_S=${GPU_CHECK_TIMEOUT_S:-450}         # hard limit of the measuring run; its own deadline is 20 s less
export GPU_CHECK_DEADLINE_S=${GPU_CHECK_DEADLINE_S:-$((TOTAL_S - 20))}

PY=python3
if ! timeout 120 python3 -c 'import jax; assert jax.default_backend() == "gpu"' >/dev/null 2>&1; then
  echo "python3's jax sees no GPU: installing the cuda extra into .venv-gpu" >&2
  if [ ! -x .venv-gpu/bin/python ]; then
    python3 -m venv .venv-gpu || exit 1
  fi
  .venv-gpu/bin/pip install -q -e ".[cuda,test]" || { echo "pip install of the cuda extra failed" >&2; exit 1; }
  PY=.venv-gpu/bin/python
fi

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  RESULT="$OUT/gpu_check.json"
  SHOW=()
else
  RESULT="$(mktemp -d)/gpu_check.json"
  SHOW=(--print-json)
fi

# -k: a run that ignores the TERM is killed 10 s later; the results file is rewritten after every
# measurement, so what was measured is reported either way.
timeout -k 10 "$TOTAL_S" "$PY" scripts/gpu_check.py --out "$RESULT" "$@"
rc=$?
if [ "$rc" -eq 2 ]; then  # no GPU (one line already printed): nothing to report
  exit 2
fi
[ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "gpu_check.py ran past ${TOTAL_S} s and was stopped" >&2
"$PY" scripts/gpu_check.py --report "$RESULT" ${SHOW[@]+"${SHOW[@]}"}
exit "$rc"
