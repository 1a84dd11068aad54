"""Where compiled kernels and autotune choices persist across restarts: Triton's on-disk cache under
the forkpoint cache directory, so a restart (after a crash, or a second server on the node) loads the
kernels it compiled before instead of compiling them again.

`configure_kernel_caches(root)` sets, in this process's environment and only where the user has not
set them: ``TRITON_CACHE_DIR=<root>/triton`` (compiled kernels; Triton's default is ~/.triton/cache)
and ``TRITON_CACHE_AUTOTUNING=1`` (every Triton autotuner, fla-core's included, keeps its timing
results in that cache; forkpoint's own autotuner keeps them unless TRITON_CACHE_AUTOTUNING is "0" when
it is imported, `autotune_choices_kept`: the start-up compile workers, runner/precompile.py, set it).
Both are read when a kernel is first compiled or autotuned, so this must run before the engine is
built (`LLM.__init__` does).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path


def kernel_cache_settings(root: Path) -> dict[str, str]:
    """The environment variables that keep kernels and autotune choices under `root`."""
    return {"TRITON_CACHE_DIR": str(root / "triton"), "TRITON_CACHE_AUTOTUNING": "1"}


def autotune_choices_kept(environ: Mapping[str, str] | None = None) -> bool:
    """Whether forkpoint's own autotuners keep their choices on disk: yes unless the environment's
    TRITON_CACHE_AUTOTUNING says no ("0", "false", "off")."""
    environ = os.environ if environ is None else environ
    return environ.get("TRITON_CACHE_AUTOTUNING", "1").strip().lower() not in ("0", "false", "off")


def configure_kernel_caches(root: Path, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set `kernel_cache_settings(root)` in `environ` (default: os.environ) where unset; create the
    Triton cache directory in use. Returns the settings now in effect (the user's where they chose)."""
    environ = os.environ if environ is None else environ
    for name, value in kernel_cache_settings(root).items():
        environ.setdefault(name, value)
    Path(environ["TRITON_CACHE_DIR"]).expanduser().mkdir(parents=True, exist_ok=True)
    return {name: environ[name] for name in kernel_cache_settings(root)}
