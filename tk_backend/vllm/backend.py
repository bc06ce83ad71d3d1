"""The TK attention backend for vLLM: which layers it accepts, the KV cache it reads, and the forward pass.

The KV cache vLLM gives each layer is one tensor, logically [num_blocks, num_kv_heads, block_size, 2*head_size]
(K and V packed along the content dim), physically NHD [num_blocks, block_size, num_kv_heads, 2*head_size] by
default. `kv_cache_views` exposes its K and V halves as [num_blocks, block_size, num_kv_heads, head_size]
strided views, without copies; the TK ops read such paged views directly.

Per layer and step: vLLM's `reshape_and_cache_flash` writes the new keys and values into those views
(`do_kv_cache_update`), then `forward` attends with the step's paged decode plan (metadata.DecodeStep: uniform decode
batches, and a mixed batch's leading one-token requests) and the paged `flash_attn_varlen_func` (everything else).
See metadata.py for how a batch is classified.

Anything the kernels do not implement is refused through vLLM's own validation hooks (so selecting TK for such a
model fails at start-up with vLLM's "Selected backend ... is not valid" and our reasons), or, for what those
hooks cannot see (ALiBi, attention sinks, context parallelism), when the layer is built.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from vllm._custom_ops import reshape_and_cache_flash
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionType

from tk_backend.attention import BLOCK_SIZES, HEAD_DIMS, flash_attn_varlen_func
from tk_backend.vllm import BACKEND_NAME, compat
from tk_backend.vllm.metadata import TKAttentionMetadata, TKAttentionMetadataBuilder

HALF_CACHE_DTYPES = ("auto", "bfloat16", "float16")
REQUIRED_CAPABILITY = (9, 0)


def kv_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V halves of a layer's cache as [num_blocks, block_size, num_kv_heads, head_size] views (no copy)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    # A dim of size 1 (one KV head per rank under tensor parallelism) may carry a stride the copy engine
    # rejects; any stride is equivalent there, so give it the canonical one.
    return canonicalize_singleton_dim_strides(key_cache), canonicalize_singleton_dim_strides(value_cache)


class TKAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(HALF_CACHE_DTYPES)
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["TKAttentionImpl"]:
        return TKAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TKAttentionMetadataBuilder]:
        return TKAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(BLOCK_SIZES)

    # vLLM 0.26 asks the backend for the cache's shape and physical order; later releases work them out.
    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        return compat.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return compat.kv_cache_stride_order(include_num_layers_dimension)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_DIMS)

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) == REQUIRED_CAPABILITY

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # Batches are classified (uniform decode or not) from the host's query lengths (vLLM >= 0.33 asks).
        return False

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        """vLLM's checks (through the supports_* hooks above), with each refusal saying what TK does support."""
        reasons = super().validate_configuration(*args, **kwargs)
        return [explain_refusal(reason, kwargs) for reason in reasons]


def _dtype_name(dtype: object) -> str:
    return str(dtype).replace("torch.", "")


def explain_refusal(reason: str, config: dict) -> str:
    """vLLM's terse reason -> one that names the received value and what the TK backend supports."""
    explained = {
        "head_size not supported":
            f"head_size {config.get('head_size')} not supported (TK kernels: multiples of 8 up to 256)",
        "dtype not supported":
            f"dtype {_dtype_name(config.get('dtype'))} not supported (TK kernels: bfloat16, float16)",
        "kv_cache_dtype not supported":
            f"kv_cache_dtype {config.get('kv_cache_dtype')} not supported (TK reads bfloat16/float16 caches; "
            "fp8 KV caches are not implemented)",
        "block_size not supported":
            f"block_size {config.get('block_size')} not supported (TK pages: multiples of {min(BLOCK_SIZES)})",
        "compute capability not supported":
            f"compute capability {config.get('device_capability')} not supported (TK kernels need sm_90, Hopper)",
        "MLA not supported": "MLA not supported (TK implements standard multi-head / grouped-query attention)",
        "attention sinks not supported": "attention sinks not supported by the TK kernels",
        "non-causal attention not supported": "non-causal decoder attention not supported by the TK backend",
        "batch invariance not supported": "batch-invariant mode (VLLM_BATCH_INVARIANT) not supported by TK",
    }
    if reason in explained:
        return explained[reason]
    if reason.startswith("attention type"):
        return f"{reason} (TK runs decoder self-attention only: no encoder, encoder-only or cross attention)"
    return f"{reason} (TK backend)"


def unsupported_layer_reasons(
    head_size: int,
    alibi_slopes: object,
    kv_cache_dtype: str,
    attn_type: str,
    sinks: object,
    dcp_world_size: int,
    pcp_world_size: int,
    extra: dict,
) -> list[str]:
    """What an attention layer asks for that the TK kernels cannot do (empty: the layer is supported)."""
    reasons = []
    if head_size not in HEAD_DIMS:
        reasons.append(f"head_size {head_size} (supported: multiples of 8 up to 256)")
    if alibi_slopes is not None:
        reasons.append("ALiBi position biases")
    if kv_cache_dtype not in HALF_CACHE_DTYPES:
        reasons.append(f"kv_cache_dtype {kv_cache_dtype} (supported: {', '.join(HALF_CACHE_DTYPES)})")
    if attn_type != AttentionType.DECODER:
        reasons.append(f"attention type {getattr(attn_type, 'value', attn_type)} (only decoder self-attention)")
    if sinks is not None:
        reasons.append("attention sinks")
    if dcp_world_size > 1:
        reasons.append(f"decode context parallelism (world size {dcp_world_size})")
    if pcp_world_size > 1:
        reasons.append(f"prefill context parallelism (world size {pcp_world_size})")
    for name, value in extra.items():
        if value not in (None, False):
            reasons.append(f"layer option {name}={value!r}")
    return reasons


class TKAttentionImpl(AttentionImpl[TKAttentionMetadata]):
    supports_dcp: bool = False
    supports_pcp: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **extra,
    ) -> None:
        reasons = unsupported_layer_reasons(
            head_size, alibi_slopes, kv_cache_dtype, attn_type, sinks,
            getattr(self, "dcp_world_size", 1), getattr(self, "pcp_world_size", 1), extra,
        )
        if reasons:
            raise NotImplementedError(
                "the TK attention backend cannot run this layer: " + "; ".join(reasons)
                + ". Choose another backend, e.g. --attention-backend FLASH_ATTN."
            )
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = sliding_window
        # vLLM's window w lets a query see itself and the w - 1 keys before it.
        self.window_size = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        self.softcap = float(logits_soft_cap) if logits_soft_cap else 0.0
        self._views_of: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_cache_views of this layer's cache, made once: vLLM passes the same tensor every step, and eager
        steps (mixed batches) pay for every host-side op of every layer."""
        if self._views_of is None or self._views_of[0] is not kv_cache:
            self._views_of = (kv_cache, kv_cache_views(kv_cache, self.head_size))
        return self._views_of[1]

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        key_cache, value_cache = self._cache_views(kv_cache)
        # key/value may hold padding rows past the real tokens: the op writes slot_mapping.shape[0] of them.
        reshape_and_cache_flash(
            key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype, layer._k_scale, layer._v_scale
        )

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TKAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, head_size] -> output [num_tokens, num_heads, head_size] (in place)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the TK attention backend does not fuse output quantization")
        if attn_metadata is None:  # memory-profiling run: no metadata, no cache
            return output.fill_(0)
        md = attn_metadata
        key_cache, value_cache = self._cache_views(kv_cache)
        rows = md.decode_batch * md.decode_query_len
        if md.is_uniform_decode and query.shape[0] >= rows:
            md.decode.run(query[:rows], key_cache, value_cache, output[:rows], softmax_scale=self.scale,
                          window_size=self.window_size, softcap=self.softcap)
            return output
        n, d = md.num_actual_tokens, md.num_decodes
        if d > 0:  # a mixed batch's leading one-token requests (metadata module docstring)
            md.decode.run(query[:d], key_cache, value_cache, output[:d], softmax_scale=self.scale,
                          window_size=self.window_size, softcap=self.softcap)
        query_start_loc = md.prefill_query_start_loc if d > 0 else md.query_start_loc
        flash_attn_varlen_func(
            query[d:n], key_cache, value_cache, query_start_loc, None, md.max_query_len, md.max_seq_len,
            softmax_scale=self.scale, causal=True, window_size=self.window_size, softcap=self.softcap,
            block_table=md.block_table[d:], seqused_k=md.seq_lens[d:], out=output[d:n],
        )
        return output
