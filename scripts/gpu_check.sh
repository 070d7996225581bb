#!/usr/bin/env bash
# One prepared, time-bounded check on a machine with one NVIDIA GPU: the copy ceiling, the correctness
# gate (every kernel path compiled for the GPU against float64), the decode, serving and prefill
# kernels against cuDNN and the copy ceiling, and a 1.1B Llama end to end against transformers. The
# stages, their budgets and the skip rule: scripts/gpu_check.py. The plan fits 360 s; this wrapper
# stops it at 390 s.
#
#   bash scripts/gpu_check.sh [--stages copy,gate,...]     # from anywhere
#
# Uses python3's own jax when it already sees a GPU (no package registry needed); otherwise makes
# .venv-gpu with the cuda extra. Results: the raw JSON in $OUT/gpu_check.json when $OUT is set (else
# printed), then the table of headline figures, printed last. Commit the JSON under docs/gpu/ beside
# the table it fills in docs/PERFORMANCE.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # transformers (torch) shares the GPU in the e2e stages
export GPU_CHECK_DEADLINE_S=${GPU_CHECK_DEADLINE_S:-360}   # the plan's budgets add up to 360 s
TOTAL_S=${GPU_CHECK_TIMEOUT_S:-$((GPU_CHECK_DEADLINE_S + 30))}  # the hard stop, above the deadline

PY=python3
if ! timeout 60 python3 -c 'import jax; assert jax.default_backend() == "gpu"' >/dev/null 2>&1; then
  echo "python3's jax sees no GPU: installing the cuda extra into .venv-gpu" >&2
  [ -x .venv-gpu/bin/python ] || python3 -m venv .venv-gpu || exit 1
  .venv-gpu/bin/pip install -q -e ".[cuda]" || { echo "pip install of the cuda extra failed" >&2; exit 1; }
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
# row, so what was measured is reported either way.
timeout -k 10 "$TOTAL_S" "$PY" scripts/gpu_check.py --out "$RESULT" "$@"
rc=$?
if [ "$rc" -eq 2 ]; then  # no GPU, or a bad argument (one line already printed): nothing to report
  exit 2
fi
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "gpu_check.py ran past ${TOTAL_S} s and was stopped" >&2
fi
"$PY" scripts/gpu_check.py --report "$RESULT" ${SHOW[@]+"${SHOW[@]}"}
exit "$rc"
