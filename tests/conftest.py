"""Every test sees 8 simulated CPU devices (set before JAX initialises its backends)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many small programs and run them briefly: XLA's cheapest CPU codegen keeps the
# suite fast (the results are the same; only LLVM's optimisation effort changes).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
