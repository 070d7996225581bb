"""Compile time out of the requests' way: JAX's persistent compilation cache for users, and an
engine's programs compiled before it serves.

The cache: `LLM.load` points JAX's persistent compilation cache at `$XDG_CACHE_HOME/dcp_jax/xla`
(`~/.cache/dcp_jax/xla`) before it compiles anything, so a second process loads the programs the
first compiled instead of compiling them again. Where it goes, by precedence:
`LLM.load(compilation_cache=DIR | "off")` (the CLIs' `--compilation-cache`), the environment
variable `DCP_JAX_CACHE_DIR` (a directory or "off"), a cache the user gave JAX itself
(`JAX_COMPILATION_CACHE_DIR`, `jax.config`), the default directory. When dcp_jax picks the
directory it keeps every program (JAX's default keeps only those that took a second to compile:
most CPU programs are quicker) and bounds the directory at `MAX_BYTES` (least recently used entries
go), unless the user set those thresholds through JAX's environment. Entries are keyed by the
program, the JAX version and the devices, so a stale one is never used. The cache is trusted code:
keep it in a directory only you can write (JAX's own warning).

Compiling ahead (`LLM.load`'s default, `COMPILE_MODES`) is `ModelRunner.compile_all()`: the step
program, every ragged step size, the token history's fill programs that a prefix hit of a request
with penalties runs, the host tier's copies. It compiles them one after another: on this project's
2-core machine 4 threads were slower than one (41 s against 27 s for the llama fixture's 8
programs; XLA's CPU compiler already uses the cores), and no larger machine has been measured.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "DCP_JAX_CACHE_DIR"
OFF = ("off", "none", "")  # settings that turn the cache off (case-insensitive)
MAX_BYTES = 4 << 30  # the default directory's bound
COMPILE_MODES = ("all", "lazy")
MODE_ENV = "DCP_JAX_COMPILE"  # `LLM.load`'s default compile mode when set ("all" otherwise)


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/dcp_jax/xla`, or `~/.cache/dcp_jax/xla`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dcp_jax" / "xla"


def resolve(setting=None) -> str | None:
    """The directory a setting names (None: off). `setting`: a path, "off" or False, or None for the
    default (`DCP_JAX_CACHE_DIR`, else a cache the user gave JAX, else `default_dir()`; off when
    the user turned JAX's cache off: JAX_ENABLE_COMPILATION_CACHE=false)."""
    import jax

    if setting is None:
        setting = os.environ.get(ENV)
        if setting is None:
            if os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").lower() in ("0", "false"):
                return None  # the user turned JAX's cache off
            own = jax.config.jax_compilation_cache_dir
            return own or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(default_dir())
    if setting is False or (isinstance(setting, str) and setting.strip().lower() in OFF):
        return None
    if not isinstance(setting, (str, os.PathLike)):
        from dcp_jax.errors import UserError

        raise UserError(f"compilation_cache must be a directory or 'off', got {setting!r}")
    return str(Path(setting).expanduser())


def configure(setting=None) -> str | None:
    """Point JAX's persistent compilation cache where `setting` says (see the module docstring) and
    return the directory in use (None: off). Call it before the process compiles what it should
    keep: a program compiled before is not written. Moving a cache already in use opens the new
    one."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = resolve(setting)
    current = jax.config.jax_compilation_cache_dir
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        cc.reset_cache()  # a cache already opened is closed (the flag is read when one opens)
        return None
    if path != current:  # made first: JAX's settings stay as they were when it cannot be
        make_dir(path, setting)
    jax.config.update("jax_enable_compilation_cache", True)
    if path == current:
        return path
    if current:  # another directory was in use: open the new one
        cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and _has_filelock():
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path


def make_dir(path: str, setting=None) -> None:
    """Make the cache directory `path` (from `setting`, as `configure` takes it), or UserError: one
    line naming where the directory came from (the argument, `DCP_JAX_CACHE_DIR`, the default)
    and the fix."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        return
    except FileExistsError:
        why = "a file is there"
    except OSError as e:
        why = e.strerror or str(e)
    from dcp_jax.errors import UserError

    if setting is not None:
        raise UserError(f"compilation_cache (--compilation-cache) {str(setting)!r}: cannot make "
                        f"the directory ({why}): give a directory you can write, or 'off'",
                        field="compilation_cache")
    if os.environ.get(ENV) is not None:
        raise UserError(f"{ENV}={os.environ[ENV]}: cannot make the compilation cache directory "
                        f"({why}): set it to a directory you can write, or 'off'")
    raise UserError(f"cannot make the compilation cache directory {path} ({why}): set {ENV} to "
                    "a directory you can write, or 'off'")


def _has_filelock() -> bool:
    """Whether JAX can bound the cache (its LRU eviction locks the directory with `filelock`)."""
    try:
        import filelock  # noqa: F401
    except ImportError:
        return False
    return True


def default_mode() -> str:
    """`LLM.load`'s compile mode when none is given: `$DCP_JAX_COMPILE`, else "all"."""
    return os.environ.get(MODE_ENV) or "all"


def check_mode(compile: str) -> str:
    """`compile` if it is one of COMPILE_MODES, else UserError."""
    if compile not in COMPILE_MODES:
        from dcp_jax.errors import UserError

        modes = ", ".join(map(repr, COMPILE_MODES))
        raise UserError(f"compile must be one of {modes}, got {compile!r}")
    return compile
