"""Everything that differs between the vLLM releases the TK backend runs on (0.26.0 ... 0.33.0), decided here.

The GPU host runs vLLM 0.26.0; users install 0.33.0. Between them the attention-backend interface changed in
these ways that touch us (checked by reading both releases' sources):

* KV cache shape. 0.26 asks each backend for the cache's logical shape (`get_kv_cache_shape`, abstract) and its
  physical order (`get_kv_cache_stride_order`, NHD or HND from `get_kv_cache_layout()`). 0.33 removed both: it
  derives the shape from the layer's AttentionSpec and the order from one `KVCacheLayout` resolved for the
  whole model (`AttentionBackend.supported_kv_cache_layouts`, None = any). Both hand `forward` the same logical
  per-layer tensor [num_blocks, num_kv_heads, block_size, 2 * head_size], NHD physical by default.
* Validation hooks. 0.33 adds `use_adaptive_verification`, `use_dcp` and `use_rswa` to
  `validate_configuration` (with hooks `supports_device_cpu_query_lens_mismatch`, `supports_dcp` read from the
  impl, `supports_rswa`); 0.26 never asks, so DCP is refused in the impl there (see backend.py).
* `get_supported_kernel_block_sizes` takes an optional `kv_cache_spec` in 0.33 (none in 0.26).
* The widest "decode" query: 0.33 has `max_decode_query_len(vllm_config)`; 0.26 computes it inline.
* `AttentionBackendEnum.register` (new names) exists only in 0.33; we do not use it (see __init__.py).

What the TK backend's features need from the selector is the same in both releases (checked in both sources):
`validate_configuration` refuses sinks through `supports_sink()` and then asks `supports_combination(head_size, ...,
has_sink, ...)` (where TK refuses sinks at head sizes other than 64/128/256), non-causal decoders through
`supports_non_causal()` (AttentionConfig.use_non_causal), layer kinds through `supports_attn_type`, head sizes through
`get_supported_head_sizes` (neither release calls a separate `validate_head_size` for standard attention). Both raise
"Selected backend {enum member} is not valid ... Reason: [...]" when the selected backend's list is not empty, and
let any other exception from `validate_configuration` through (0.26 catches ImportError, 0.33 ImportError and
OSError), which is how TK says its own sentence (backend.py). `CommonAttentionMetadata.causal` is `bool | Tensor`
in both (a tensor: per-sequence causality); encoder-only layers get the same metadata in both (EncoderOnlyAttention
wraps the backend's builder to set causal False; the model runner gives the EncoderOnlyAttentionSpec group a
[num_reqs, 1] block table of zeros and a slot mapping of zeros), and both pass `sinks` to the impl as a keyword,
the model's parameter in the model's dtype.

Differences that need no gate because the backend is written to both: the impl's `supports_dcp` default flipped
(True in 0.26, False in 0.33; we set False); `get_required_kv_cache_layout` became `supported_kv_cache_layouts`
(both default to "any", which is what we want); `CommonAttentionMetadata.seq_lens_cpu` and the builder's
`use_cascade_attention` are gone in 0.33 (we use neither); `common_prefix_len` is always 0 in 0.33 (we ignore it).

Features are detected by presence rather than by comparing version numbers, so releases between 0.26 and
0.33 that we could not inspect take whichever side they actually implement.
"""
from __future__ import annotations

import inspect

import vllm
from packaging.version import Version
from vllm.v1.attention.backend import AttentionBackend

MIN_VLLM = (0, 26)
VLLM_VERSION = Version(vllm.__version__).release

# 0.26: the backend declares the KV cache's logical shape and physical stride order.
BACKEND_DECLARES_KV_SHAPE = hasattr(AttentionBackend, "get_kv_cache_shape")


def selector_arguments(*args, **kwargs) -> dict:
    """validate_configuration's arguments by name, as the installed vLLM declares them (0.33 has three more)."""
    bound = inspect.signature(AttentionBackend.validate_configuration).bind_partial(*args, **kwargs)
    return dict(bound.arguments)


def require_supported_vllm() -> None:
    if VLLM_VERSION[:2] < MIN_VLLM:
        raise ImportError(f"the TK attention backend needs vLLM >= {'.'.join(map(str, MIN_VLLM))}, "
                          f"found {vllm.__version__}")


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, int, int, int]:
    """vLLM's standard logical KV cache shape: K and V packed along the content dim."""
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
    """Physical order of kv_cache_shape's dims (0.26 only), the same as vLLM's FlashAttention backend chooses."""
    if not BACKEND_DECLARES_KV_SHAPE:
        raise NotImplementedError(f"vLLM {vllm.__version__} derives the KV cache layout itself")
    from vllm.v1.attention.backends.utils import get_kv_cache_layout

    layout = get_kv_cache_layout()
    orders = {
        # (num_blocks, [num_layers,] block_size, num_kv_heads, 2*head_size)
        ("NHD", False): (0, 2, 1, 3),
        ("NHD", True): (1, 0, 3, 2, 4),
        # (num_blocks, num_kv_heads, [num_layers,] block_size, 2*head_size)
        ("HND", False): (0, 1, 2, 3),
        ("HND", True): (1, 2, 0, 3, 4),
    }
    if (layout, include_num_layers_dimension) not in orders:
        raise ValueError(f"unknown KV cache layout {layout!r}")
    return orders[(layout, include_num_layers_dimension)]


def max_decode_query_len(vllm_config) -> int:
    """The widest per-request query vLLM batches as a uniform decode (1 + speculative tokens)."""
    try:  # vLLM >= 0.33
        from vllm.v1.attention.backend import max_decode_query_len as vllm_max_decode_query_len
    except ImportError:
        vllm_max_decode_query_len = None
    if vllm_max_decode_query_len is not None:
        return vllm_max_decode_query_len(vllm_config)
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.num_speculative_tokens is None:
        return 1
    per_draft = 2 if getattr(spec, "parallel_drafting", False) else 1
    return 1 + per_draft * spec.num_speculative_tokens


def query_group(vllm_config, kv_cache_spec) -> int:
    """Query heads per kv head on this rank (1 where the model config does not say)."""
    model = getattr(vllm_config, "model_config", None)
    kv_heads = getattr(kv_cache_spec, "num_kv_heads", 0)
    if model is None or not kv_heads:
        return 1
    return max(model.get_num_attention_heads(vllm_config.parallel_config) // kv_heads, 1)
