"""tk_backend: ThunderKittens-style Hopper kernels (GEMM, attention, linear attention, SSD) for PyTorch and vLLM."""
from tk_backend._library import extension_available
from tk_backend.attention import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from tk_backend.gemm import gemm

__all__ = ["extension_available", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "gemm"]
__version__ = "0.1.0"
