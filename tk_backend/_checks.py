"""Input validation shared by the public ops: errors name the argument, the expected and the received value."""
from __future__ import annotations

from collections.abc import Iterable

import torch

HALF_TYPES = (torch.bfloat16, torch.float16)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    names = [str(d).replace("torch.", "") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def tensor(
    t: object,
    name: str,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    cuda: bool = True,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {t.dim()} (shape {tuple(t.shape)})")
    if cuda and t.device.type != "cuda" and t.device.type != "meta":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    return t


def same_device(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def same_dtype(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")


def shape(t: torch.Tensor, name: str, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def tma_ready(t: torch.Tensor) -> bool:
    """Row-major rows the copy engine can address: unit inner stride, 16-byte aligned base and row strides."""
    es = t.element_size()
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return False
    if t.device.type == "cuda" and t.data_ptr() % 16:
        return False
    return all(t.shape[d] == 1 or (t.stride(d) * es) % 16 == 0 for d in range(t.dim() - 1))
