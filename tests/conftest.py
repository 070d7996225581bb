"""Every test sees 8 simulated CPU devices (set before JAX initialises its backends)."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many small programs and run them briefly: XLA's cheapest CPU codegen keeps the
# suite fast (the results are the same; only LLVM's optimisation effort changes).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Many tests compile the same small programs (the fixtures' step programs on the same meshes), in every
# xdist worker: JAX's persistent compilation cache, in this process only (subprocesses such as the
# compile-time benchmark compile for themselves), keeps one copy. Keyed by the program and the JAX
# version, so a stale entry is never used; tests that count compilations count the runner's own table.
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(tempfile.gettempdir(), f"dcp_jax-tests-xla-cache-{os.getuid()}"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_compilation_cache_max_size", 1 << 30)  # least recently used entries go past 1 GiB
