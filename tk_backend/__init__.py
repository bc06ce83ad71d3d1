"""tk_backend: ThunderKittens-style Hopper kernels (GEMM, attention, linear attention, SSD) for PyTorch and vLLM."""
from tk_backend._library import extension_available
from tk_backend.gemm import gemm

__all__ = ["extension_available", "gemm"]
__version__ = "0.1.0"
