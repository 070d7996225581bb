"""Every test sees 8 simulated CPU devices (set before JAX initialises its backends)."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many small programs and run them briefly: XLA's cheapest CPU codegen keeps the
# suite fast (the results are the same; only LLVM's optimisation effort changes).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# Many tests compile the same small programs (the fixtures' step programs on the same meshes), in every
# xdist worker and in the processes tests start (scripts' workers, multi-process pairs, the notebook's
# kernel): JAX's persistent compilation cache, set through the environment (read by JAX at import, here
# and in every child), keeps one copy. Keyed by the program and the JAX version, so a stale entry is never
# used; tests that count compilations count the runner's own table, and no test asserts a compile time.
for key, value in {"JAX_COMPILATION_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"dcp_jax-tests-xla-cache-{os.getuid()}"),
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
                   "JAX_COMPILATION_CACHE_MAX_SIZE": str(1 << 30)}.items():  # least recently used entries go past 1 GiB
    os.environ.setdefault(key, value)
# `LLM.load` compiles every program a request may run by default (what a user wants once it
# returns); most tests run a few steps of one size, so they compile what they run, in this
# process and in the processes they start (tests/test_compile.py asks for "all" where it checks
# the default).
os.environ.setdefault("DCP_JAX_COMPILE", "lazy")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
