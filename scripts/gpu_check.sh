#!/usr/bin/env bash
# One prepared check for a GPU machine (well under 10 minutes): kernel tests compiled for the GPU (no
# interpreter), the kernel timed against the jnp reference and jax.nn.dot_product_attention at 8K-128K
# keys with its bandwidth against a device copy, and one end-to-end generation. JSON on stdout.
#   bash scripts/gpu_check.sh            # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-gpu/bin/python ]; then
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q -e ".[cuda,test]"
fi
export JAX_PLATFORMS=cuda
timeout 540 .venv-gpu/bin/python scripts/gpu_check.py "$@"
