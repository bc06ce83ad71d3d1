"""tk_backend: ThunderKittens-style Hopper kernels (GEMM, attention, linear attention, SSD) for PyTorch and vLLM."""
from tk_backend._library import extension_available
from tk_backend import based
from tk_backend.attention import (
    DecodeWorkspacePool,
    PagedDecode,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from tk_backend.gemm import gemm
from tk_backend.mamba import mamba_chunk_scan_combined, mamba_chunk_scan_varlen, selective_state_update

__all__ = ["DecodeWorkspacePool", "PagedDecode", "based", "extension_available", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache", "gemm", "mamba_chunk_scan_combined",
           "mamba_chunk_scan_varlen", "selective_state_update"]
__version__ = "0.1.0"
