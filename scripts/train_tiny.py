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

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dcp_jax import make_mesh
from dcp_jax.cli import (USAGE_ERROR, RUN_ERROR, CliParser, UsageError, integer, non_negative_int,
                         positive_float, positive_int)
from dcp_jax.config import ModelConfig
from dcp_jax.errors import UserError
from dcp_jax.model import CausalLM, random_source
from dcp_jax.weights import ByteTokenizer, DictSource, save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers
import corpus  # noqa: E402  scripts/corpus.py: the text and its held-out split

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "dcp_jax" / "assets" / "tiny"
LOG = "training_log.json"  # with orbax's numbered step directories, what --out holds

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


def parse_args(argv=None):
    """The flags, checked before anything trains: UsageError (one line) for a bad value or an
    --out that holds anything but this script's previous output."""
    p = CliParser(description=__doc__.split("\n\n")[0])
    held = len(corpus.split()[1])
    p.add_argument("--steps", type=integer("--steps", 2), default=1200,
                   help="training steps, >= 2: warm-up, then cosine decay (default 1200)")
    p.add_argument("--batch", type=positive_int("--batch"), default=16)
    p.add_argument("--seq-len", type=integer("--seq-len", 1, held - 2), default=256,
                   help="bytes per training window (at most the held-out text, less 2)")
    p.add_argument("--lr", type=positive_float("--lr"), default=3e-3)
    p.add_argument("--seed", type=non_negative_int("--seed"), default=0)
    p.add_argument("--eval-every", type=positive_int("--eval-every"), default=100)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="the checkpoint directory: new, empty, or this script's previous output "
                        "(replaced only once the new one is saved)")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    if (problem := out_problem(args.out)) is not None:
        raise UsageError(problem)
    return args


def previous_output(out: Path) -> bool:
    """Whether the directory `out` holds what this script writes there and nothing else: its
    training log (a run's config and loss curve) and orbax's numbered step directories."""
    try:
        log = json.loads((out / LOG).read_text())
        rest = [e for e in out.iterdir() if e.name != LOG]
    except (OSError, ValueError):
        return False
    return (isinstance(log, dict) and {"config", "train"} <= log.keys() and bool(rest)
            and all(e.name.isdigit() and e.is_dir() and not e.is_symlink() for e in rest))


def out_problem(out: Path) -> str | None:
    """Why the output cannot go to `out` (None: it can). `out` may be missing, an empty directory
    or this script's previous output, in a directory this process may write."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file: give a directory path for the checkpoint"
    base = out.parent
    if out.is_dir():
        try:
            empty = not any(out.iterdir())
        except OSError as e:
            return f"--out {out} cannot be read ({e.strerror}): give a directory you can write"
        if not empty and not previous_output(out):
            return (f"--out {out} holds files this script did not write: give a new or empty "
                    "directory (only a previous train_tiny.py output is replaced)")
    else:
        while not base.exists() and base != base.parent:
            base = base.parent
    if not base.is_dir():
        return f"--out {out}: {base} is not a directory: give a path in a writable directory"
    try:  # the new output is written beside `out`: try it now, not after training
        tempfile.TemporaryDirectory(prefix=".train_tiny.probe-", dir=base).cleanup()
    except OSError as e:
        return (f"--out {out}: cannot write in {base} ({e.strerror}): give a path in a "
                "writable directory")
    return None


def save_output(out: Path, shipped, log: dict) -> None:
    """Save the checkpoint and its log to a new sibling of `out`, then swap it in: the previous
    output is renamed aside, the new one renamed to `out`, then the old one deleted. A failed save
    leaves `out` as it was."""
    new = out.with_name(f".{out.name}.new-{os.getpid()}-{time.time_ns()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        new.mkdir()
        save_checkpoint(shipped, new, ByteTokenizer())
        (new / LOG).write_text(json.dumps(log))
    except BaseException as e:
        shutil.rmtree(new, ignore_errors=True)
        if isinstance(e, OSError):
            raise UserError(f"--out {out}: cannot save the checkpoint ({e}); {out} is as it was"
                            ) from None
        raise
    if (problem := out_problem(out)) is not None:  # something else wrote there meanwhile
        raise UserError(f"{problem}; this run's output is kept in {new}")
    try:
        swap_in(new, out)
    except OSError as e:
        raise UserError(f"--out {out}: cannot move the new output there ({e}); it is kept in "
                        f"{new}") from None


def swap_in(new: Path, out: Path) -> None:
    """Rename `new` to `out`; a directory at `out` is renamed aside first and deleted last, so
    `out` holds the old output or the new one, whole (none only between two renames)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}-{time.time_ns()}")
        os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old)


def write_atomic(path: Path, write) -> None:
    """`write(tmp)` to a sibling of `path`, then rename it over `path`: whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def train(args, train_text, held, cfg, mesh):
    """Train from the seed: (the model's graphdef, its trained params, the log, parameters)."""
    model = CausalLM(cfg, random_source(cfg, mesh, seed=args.seed, scale=1.0), mesh)
    graphdef, params = nnx.split(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"model: {n_params:,} parameters", flush=True)

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1),
                                                  args.steps, args.lr * 0.05)
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
    n = args.seq_len
    held_batches = np.stack([held[i:i + n + 1] for i in range(0, len(held) - n - 1, n)])

    def held_out(params):
        return float(np.mean([eval_loss(params, held_batches[i:i + 16])
                              for i in range(0, len(held_batches), 16)]))

    rng = np.random.default_rng(args.seed)
    log = {"config": CONFIG, "args": {k: str(v) for k, v in vars(args).items()}, "train": [],
           "held_out": []}
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(train_text) - n - 1, args.batch)
        batch = np.stack([train_text[s:s + n + 1] for s in starts])
        params, opt_state, loss = train_step(params, opt_state, batch)
        log["train"].append([step, float(loss)])
        if step % 10 == 0 or step == 1:
            print(f"step {step:5d}  train loss {float(loss):.4f}  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            h = held_out(params)
            log["held_out"].append([step, h])
            print(f"step {step:5d}  held-out loss {h:.4f} nats/byte "
                  f"({h / np.log(2):.3f} bits/byte)", flush=True)
    log["train_seconds"] = time.perf_counter() - t0
    log["final_held_out_loss"] = log["held_out"][-1][1]
    print(f"trained {args.steps} steps in {log['train_seconds']:.0f} s; "
          f"held-out loss {log['final_held_out_loss']:.4f}")
    return graphdef, params, log, n_params


def plot(log: dict, n_params: int, path: Path) -> None:
    """The loss curve as a PNG at `path` (a note on stderr without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss-curve PNG (pip install matplotlib)",
              file=sys.stderr)
        return
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
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    train_text, held = (np.frombuffer(x, np.uint8).astype(np.int32) for x in corpus.split())
    print(f"corpus: {len(train_text) + len(held):,} bytes; train {len(train_text):,}, "
          f"held-out {len(held):,}", flush=True)
    cfg = ModelConfig.from_dict(CONFIG)
    mesh = make_mesh(1, 1)
    graphdef, params, log, n_params = train(args, train_text, held, cfg, mesh)

    # Save in bfloat16 (a few MB) as an orbax checkpoint, swapped in whole (save_output).
    model = nnx.merge(graphdef, params)
    weights = {k: v.astype(jnp.bfloat16) for k, v in model.hf_weights().items()}
    shipped = CausalLM(cfg, DictSource(weights, cfg, mesh, jnp.bfloat16), mesh)
    try:
        save_output(args.out, shipped, log)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR
    prompt = default_prompt(held.astype(np.uint8).tobytes())
    write_atomic(args.out.parent / "default_prompt.txt", lambda tmp: tmp.write_text(prompt))
    plot(log, n_params, args.out.parent / "tiny_loss.png")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
