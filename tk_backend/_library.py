"""The `tk` torch.library namespace and the compiled extension that implements it on CUDA.

Schemas are defined here, in Python, so that fake (meta) implementations and input validation work on
any machine; importing `tk_backend._C` registers the CUDA kernels behind them.
"""
from __future__ import annotations

import functools

import torch

lib = torch.library.Library("tk", "DEF")

_BUILD_HINT = "build it with `pip install --no-build-isolation -e .` (needs nvcc and a CUDA build of torch)"


@functools.lru_cache(maxsize=None)
def _load() -> tuple[bool, str]:
    try:
        from tk_backend import _C  # noqa: F401  (registers torch.ops.tk CUDA kernels)
    except ImportError as exc:
        return False, f"tk_backend._C could not be imported ({exc}); {_BUILD_HINT}"
    return True, ""


def extension_available() -> bool:
    return _load()[0]


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def require_kernels(t: torch.Tensor) -> None:
    """Raise a clear error unless `t` lives on an sm_90 GPU and the extension is built."""
    ok, why = _load()
    if not ok:
        raise RuntimeError(why)
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    major, minor = _capability(index)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(
            f"tk_backend kernels need an sm_90 (Hopper) GPU; {t.device} is {name} (sm_{major}{minor})"
        )
