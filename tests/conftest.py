"""Test tiers: CPU tests always run; tests marked `gpu` need an sm_90 GPU and the built extension."""
from __future__ import annotations

import pytest
import torch


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs sm_90, found {torch.cuda.get_device_name()} {torch.cuda.get_device_capability()}"
    import tk_backend

    if not tk_backend.extension_available():
        return "tk_backend._C is not built"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            reason = reason or _gpu_skip_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def seed():
    """A fresh seed per test (recorded in the test id output on failure through the assertion message)."""
    import random

    s = random.randrange(1 << 30)
    torch.manual_seed(s)
    return s
