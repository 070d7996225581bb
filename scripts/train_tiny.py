"""Train the tiny default model that `python -m dcp_jax.generate` runs with no arguments.

A small Llama-family decoder over a byte-level vocabulary (256 ids, no tokenizer file) trained with
optax on the text of Python's own documentation topics (`pydoc_data.topics`, shipped with CPython),
on CPU. The last 5% of the text is held out. Reproducible from the seed:

    python scripts/train_tiny.py                 # ~20 min on 2 CPU cores; writes dcp_jax/assets/tiny
    python scripts/train_tiny.py --steps 20 --out /tmp/tiny   # a quick look

It prints training loss per step and held-out loss every `--eval-every` steps (nats per byte), writes
the loss curve as a PNG and a JSON log next to the checkpoint, and saves the model as an orbax
checkpoint (weights in bfloat16 to keep the package small) with its config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dcp_jax import make_mesh
from dcp_jax.config import ModelConfig
from dcp_jax.model import CausalLM, random_source
from dcp_jax.weights import ByteTokenizer, DictSource, save_checkpoint

import corpus  # scripts/corpus.py: the text and its held-out split

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "dcp_jax" / "assets" / "tiny"

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 65536,
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "eos_token_id": None,
}


def default_prompt(held: bytes, size: int = 160) -> str:
    """The default run's prompt: about `size` bytes of held-out text, from a line start, ending mid-line
    so the model has something to continue. Prompt + the default run's 96 new bytes stay within the
    256-byte windows the model was trained on."""
    text = held.decode("utf-8", errors="ignore")
    start = text.index("\n", len(text) // 3) + 1
    chunk = text[start:start + size]
    return chunk[: chunk.rstrip().rfind(" ") + 1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)

    train, held = (np.frombuffer(x, np.uint8).astype(np.int32) for x in corpus.split())
    print(f"corpus: {len(train) + len(held):,} bytes; train {len(train):,}, held-out {len(held):,}", flush=True)

    cfg = ModelConfig.from_dict(CONFIG)
    mesh = make_mesh(1, 1)
    model = CausalLM(cfg, random_source(cfg, mesh, seed=args.seed, scale=1.0), mesh)
    graphdef, params = nnx.split(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"model: {n_params:,} parameters", flush=True)

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1), args.steps,
                                                  args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = opt.init(params)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params).forward(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(loss_fn)
    held_batches = [held[i:i + args.seq_len + 1] for i in range(0, len(held) - args.seq_len - 1, args.seq_len)]
    held_batches = np.stack(held_batches)

    def held_out(params):
        return float(np.mean([eval_loss(params, held_batches[i:i + 16])
                              for i in range(0, len(held_batches), 16)]))

    rng = np.random.default_rng(args.seed)
    log = {"config": CONFIG, "args": {k: str(v) for k, v in vars(args).items()}, "train": [], "held_out": []}
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(train) - args.seq_len - 1, args.batch)
        batch = np.stack([train[s:s + args.seq_len + 1] for s in starts])
        params, opt_state, loss = train_step(params, opt_state, batch)
        log["train"].append([step, float(loss)])
        if step % 10 == 0 or step == 1:
            print(f"step {step:5d}  train loss {float(loss):.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            h = held_out(params)
            log["held_out"].append([step, h])
            print(f"step {step:5d}  held-out loss {h:.4f} nats/byte ({h / np.log(2):.3f} bits/byte)", flush=True)
    train_s = time.perf_counter() - t0
    log["train_seconds"] = train_s
    log["final_held_out_loss"] = log["held_out"][-1][1]
    print(f"trained {args.steps} steps in {train_s:.0f} s; held-out loss {log['final_held_out_loss']:.4f}")

    # Save in bfloat16 (a few MB), atomically, as an orbax checkpoint.
    model = nnx.merge(graphdef, params)
    weights = {k: v.astype(jnp.bfloat16) for k, v in model.hf_weights().items()}
    shipped = CausalLM(cfg, DictSource(weights, cfg, mesh, jnp.bfloat16), mesh)
    if args.out.exists():
        import shutil

        shutil.rmtree(args.out)
    save_checkpoint(shipped, args.out, ByteTokenizer())
    (args.out / "training_log.json").write_text(json.dumps(log))
    (args.out.parent / "default_prompt.txt").write_text(default_prompt(held.astype(np.uint8).tobytes()))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        tr = np.asarray(log["train"])
        ho = np.asarray(log["held_out"])
        ax.plot(tr[:, 0], tr[:, 1], lw=0.8, label="train")
        ax.plot(ho[:, 0], ho[:, 1], "o-", label="held-out")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / byte)")
        ax.set_title(f"tiny byte-level Llama, {n_params / 1e6:.2f}M params, pydoc topics")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.out.parent / "tiny_loss.png", dpi=100)
    except ImportError:
        print("matplotlib not installed: no loss-curve PNG (pip install matplotlib)", file=sys.stderr)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
