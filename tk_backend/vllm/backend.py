"""The TK attention backend for vLLM: which layers it accepts, the KV cache it reads, and the forward pass.

The KV cache vLLM gives each layer is one tensor, logically [num_blocks, num_kv_heads, block_size, 2*head_size]
(K and V packed along the content dim), physically NHD [num_blocks, block_size, num_kv_heads, 2*head_size] by
default. `kv_cache_views` exposes its K and V halves as [num_blocks, block_size, num_kv_heads, head_size]
strided views, without copies; the TK ops read such paged views directly.

Per layer and step: vLLM's `reshape_and_cache_flash` writes the new keys and values into those views
(`do_kv_cache_update`), then `forward` attends with the step's paged decode plan (metadata.DecodeStep: uniform decode
batches, and a mixed batch's leading one-token requests) and the paged `flash_attn_varlen_func` (everything else).
See metadata.py for how a batch is classified.

What a layer may ask for, as vLLM's FLASH_ATTN takes it:
* attention sinks (gpt-oss: a [num_heads] logit per query head; vLLM's parameter is in the model's dtype, the
  kernels read float32) at head sizes 64, 128 and 256;
* any head size that is a multiple of 8 up to 256 (Phi-3's 96 runs on the next kernel tile);
* bidirectional decoder batches (CommonAttentionMetadata.causal False): a causal sliding window (w, 0) becomes
  (w, w), as FLASH_ATTN's _maybe_symmetrize_window makes it;
* encoder-only layers (AttentionType.ENCODER_ONLY: BERT-like embedding and reranking models): no KV cache, each
  prompt attends over its own keys with a symmetric window (w - 1, w - 1).

Anything else is refused at start-up with one sentence naming the feature, the value received and what TK
supports: TKAttentionBackend.validate_configuration raises it (TKUnsupportedError) when vLLM's selector checks the
backend (vLLM's own "Selected backend AttentionBackendEnum.CUSTOM is not valid" would name the enum member the
plugin registers TK as, see tk_backend/vllm/__init__.py), and TKAttentionImpl refuses what the selector cannot see
(ALiBi, sinks of the wrong shape, context parallelism under vLLM 0.26, unknown layer options).
"""
from __future__ import annotations

from typing import ClassVar

import torch
from vllm._custom_ops import reshape_and_cache_flash
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionType

from tk_backend.attention import BLOCK_SIZES, HEAD_DIMS, TILE_HEAD_DIMS, flash_attn_varlen_func
from tk_backend.vllm import BACKEND_NAME, compat
from tk_backend.vllm.metadata import TKAttentionMetadata, TKAttentionMetadataBuilder

HALF_CACHE_DTYPES = ("auto", "bfloat16", "float16")
# FP8 (e4m3) caches: vLLM writes x / k_scale (v_scale) as e4m3 bytes; the ops read them with k / v descales.
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
CACHE_DTYPES = HALF_CACHE_DTYPES + FP8_CACHE_DTYPES
REQUIRED_CAPABILITY = (9, 0)
ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)
SINK_HEAD_SIZES = TILE_HEAD_DIMS


class TKUnsupportedError(ValueError, NotImplementedError):
    """A model or layer the TK backend cannot run, refused at start-up (refusal's sentence)."""


def refusal(reasons: list[str]) -> str:
    """The one sentence a refusal says: every reason (feature, value received, what TK supports) and what to do."""
    return ("the TK attention backend (--attention-backend TK) cannot run this model: " + "; ".join(reasons)
            + "; choose another backend, for example --attention-backend FLASH_ATTN")


def kv_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V halves of a layer's cache as [num_blocks, block_size, num_kv_heads, head_size] views (no copy)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    # A dim of size 1 (one KV head per rank under tensor parallelism) may carry a stride the copy engine
    # rejects; any stride is equivalent there, so give it the canonical one.
    return canonicalize_singleton_dim_strides(key_cache), canonicalize_singleton_dim_strides(value_cache)


class TKAttentionBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(CACHE_DTYPES)
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

    # The selector hooks (the same in vLLM 0.26 and 0.33: compat.py).
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
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in ATTN_TYPES

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # Batches are classified (uniform decode or not) from the host's query lengths (vLLM >= 0.33 asks).
        return False

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        if has_sink and head_size not in SINK_HEAD_SIZES:
            return sinks_head_size_reason(head_size)
        return None

    @classmethod
    def configuration_refusals(cls, *args, **kwargs) -> list[str]:
        """vLLM's checks (through the hooks above) of a selector configuration, each refusal in TK's words."""
        config = compat.selector_arguments(*args, **kwargs)
        return [explain_refusal(reason, config) for reason in super().validate_configuration(*args, **kwargs)]

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        """[] when TK runs the configuration; otherwise raises TKUnsupportedError with refusal's sentence, since
        vLLM's own error would name the backend AttentionBackendEnum.CUSTOM. vLLM asks only for the backend the
        user selected (TK is never among the backends it tries on its own)."""
        reasons = cls.configuration_refusals(*args, **kwargs)
        if reasons:
            raise TKUnsupportedError(refusal(reasons))
        return []


def _dtype_name(dtype: object) -> str:
    return str(dtype).replace("torch.", "")


def _attn_type_name(attn_type: object) -> str:
    return str(getattr(attn_type, "value", attn_type))


def _capability_name(capability: object) -> str:
    major, minor = getattr(capability, "major", None), getattr(capability, "minor", None)
    return f"sm_{major}{minor}" if major is not None else str(capability)


def head_size_reason(head_size: object) -> str:
    return f"head_size {head_size} is not supported (TK: multiples of 8 up to 256)"


def kv_cache_dtype_reason(kv_cache_dtype: object) -> str:
    why = "e5m2 is refused, as FLASH_ATTN (FA3) refuses it" if "e5m2" in str(kv_cache_dtype) else "other formats"
    return (f"kv_cache_dtype {kv_cache_dtype} is not supported (TK reads {'/'.join(CACHE_DTYPES)} caches: {why}; "
            "use --kv-cache-dtype fp8)")


def attn_type_reason(attn_type: object) -> str:
    return (f"attention type {_attn_type_name(attn_type)} is not supported (TK: decoder self-attention and "
            "encoder-only attention; no encoder-decoder cross attention)")


def sinks_head_size_reason(head_size: object) -> str:
    return (f"attention sinks at head_size {head_size} are not supported (TK's sink kernels: head sizes "
            f"{', '.join(map(str, SINK_HEAD_SIZES))})")


def context_parallel_reason(kind: str, world_size: object) -> str:
    return (f"{kind} context parallelism ({kind}_context_parallel_size {world_size}) is not supported (TK: tensor "
            "parallelism only)")


def explain_refusal(reason: str, config: dict) -> str:
    """vLLM's terse reason -> one that names the feature, the value received and what the TK backend supports."""
    explained = {
        "head_size not supported": lambda: head_size_reason(config.get("head_size")),
        "dtype not supported": lambda: f"dtype {_dtype_name(config.get('dtype'))} is not supported (TK: bfloat16, "
                                       "float16)",
        "kv_cache_dtype not supported": lambda: kv_cache_dtype_reason(config.get("kv_cache_dtype")),
        "block_size not supported": lambda: f"block_size {config.get('block_size')} is not supported (TK pages: "
                                            f"{', '.join(map(str, BLOCK_SIZES))} tokens)",
        "compute capability not supported":
            lambda: f"compute capability {_capability_name(config.get('device_capability'))} is not supported (TK "
                    "kernels: sm_90, Hopper)",
        "MLA not supported": lambda: "MLA (use_mla=True) is not supported (TK: multi-head, grouped-query and "
                                     "multi-query attention)",
        "sparse not supported": lambda: "sparse attention (use_sparse=True) is not supported (TK: dense attention)",
        "partial multimodal token full attention not supported":
            lambda: "bidirectional attention over multimodal prefix tokens (use_mm_prefix=True) is not supported "
                    "(TK: causal or fully bidirectional batches)",
        "per-head quant scales not supported":
            lambda: "per-head quantization scales (use_per_head_quant_scales=True) are not supported (TK: "
                    "unquantized bfloat16/float16 attention)",
        "batch invariance not supported":
            lambda: "batch-invariant mode (VLLM_BATCH_INVARIANT=1) is not supported (TK's split-KV decode depends "
                    "on the batch)",
        "R-SWA not supported": lambda: "R-SWA (a model rswa_window) is not supported (TK: plain sliding windows)",
        "PCP not supported": lambda: context_parallel_reason("prefill", "> 1"),
        "DCP not supported": lambda: context_parallel_reason("decode", "> 1"),
    }
    if "(TK" in reason:  # ours already (supports_combination)
        return reason
    if reason in explained:
        return explained[reason]()
    if reason.startswith("attention type"):
        return attn_type_reason(config.get("attn_type", reason.split()[2]))
    if reason.startswith("device-cpu query lens mismatch"):
        return ("adaptive speculative verification (enable_adaptive_verification=True) is not supported (TK "
                "classifies batches from the host's query lengths; fixed-length verification works)")
    return f"{reason} (TK backend)"


def unsupported_layer_reasons(
    num_heads: int,
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
        reasons.append(head_size_reason(head_size))
    if alibi_slopes is not None:
        reasons.append(f"ALiBi position biases ({len(alibi_slopes)} slopes) are not supported (TK: no bias on the "
                       "scores; rotary-embedding models work)")
    if kv_cache_dtype not in CACHE_DTYPES:
        reasons.append(kv_cache_dtype_reason(kv_cache_dtype))
    if attn_type not in ATTN_TYPES:
        reasons.append(attn_type_reason(attn_type))
    if sinks is not None:
        shape = tuple(getattr(sinks, "shape", ()))
        if shape != (num_heads,):
            reasons.append(f"attention sinks of shape {shape} are not supported (TK: one per query head, shape "
                           f"({num_heads},))")
        elif head_size not in SINK_HEAD_SIZES:
            reasons.append(sinks_head_size_reason(head_size))
    if dcp_world_size > 1:
        reasons.append(context_parallel_reason("decode", dcp_world_size))
    if pcp_world_size > 1:
        reasons.append(context_parallel_reason("prefill", pcp_world_size))
    for name, value in extra.items():
        if value not in (None, False):
            reasons.append(f"layer option {name}={value!r} is not supported (TK backend)")
    return reasons


def _windows(sliding_window: int | None, attn_type: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(window of causal batches, window of bidirectional batches) for vLLM's sliding window w, which lets a query
    see itself and the w - 1 keys before it (and, bidirectional, the w - 1 after it). Encoder-only layers are
    bidirectional in both, as FLASH_ATTN sets them."""
    if sliding_window is None:
        return (-1, -1), (-1, -1)
    symmetric = (sliding_window - 1, sliding_window - 1)
    return (symmetric if attn_type == AttentionType.ENCODER_ONLY else (sliding_window - 1, 0)), symmetric


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
            num_heads, head_size, alibi_slopes, kv_cache_dtype, attn_type, sinks,
            getattr(self, "dcp_world_size", 1), getattr(self, "pcp_world_size", 1), extra,
        )
        if reasons:
            raise TKUnsupportedError(refusal(reasons))
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_cache = kv_cache_dtype in FP8_CACHE_DTYPES
        self.attn_type = attn_type
        self.encoder_only = attn_type == AttentionType.ENCODER_ONLY
        # Over an FP8 cache vLLM hands FLASH_ATTN and TRITON_ATTN the query quantized per tensor (layer._q_scale):
        # TK takes the same, so it serves the answers they do (decode computes Q K^T on it in e4m3, prefill widens it
        # back exactly; q_descale scales the scores).
        self.supports_quant_query_input = self.fp8_cache and not self.encoder_only
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sliding_window = sliding_window
        self.window_size, self.bidirectional_window_size = _windows(sliding_window, attn_type)
        self.softcap = float(logits_soft_cap) if logits_soft_cap else 0.0
        # The model's parameter itself (loaded after this), in its dtype: kernel_sinks converts it.
        self.sinks = sinks
        self._views_of: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None

    def kernel_sinks(self) -> torch.Tensor | None:
        """The layer's sinks as the kernels read them (float32 [num_heads]). vLLM keeps them as a parameter in the
        model's dtype, loaded (or reloaded) after the layer is built: converted at each call (one tiny kernel, also
        in a captured graph, which so reads the live parameter), not cached."""
        if self.sinks is None or self.sinks.dtype == torch.float32:
            return self.sinks
        return self.sinks.float()

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
        if self.encoder_only:  # no KV cache: forward reads key and value themselves
            return
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
        sinks = self.kernel_sinks()
        quantized_query = query.dtype == torch.float8_e4m3fn  # decode takes it as it is; prefill widens it (exact)
        if self.encoder_only:
            return self._forward_encoder_only(query, key, value, md, output, sinks)
        window = self.window_size if md.causal else self.bidirectional_window_size
        common = dict(softmax_scale=self.scale, window_size=window, softcap=self.softcap, sinks=sinks)
        key_cache, value_cache = self._cache_views(kv_cache)
        rows = md.decode_batch * md.decode_query_len
        if md.is_uniform_decode and query.shape[0] >= rows:
            md.decode.run(query[:rows], key_cache, value_cache, output[:rows], **common,
                          **self._descales(layer, md.decode_batch, quantized_query))
            return output
        n, d = md.num_actual_tokens, md.num_decodes
        if d > 0:  # a mixed batch's leading one-token requests (metadata module docstring)
            md.decode.run(query[:d], key_cache, value_cache, output[:d], **common,
                          **self._descales(layer, d, quantized_query))
        query_start_loc = md.prefill_query_start_loc if d > 0 else md.query_start_loc
        flash_attn_varlen_func(
            query[d:n].to(output.dtype) if quantized_query else query[d:n], key_cache, value_cache, query_start_loc, None, md.max_query_len, md.max_seq_len,
            causal=md.causal, block_table=md.block_table[d:], seqused_k=md.seq_lens[d:], out=output[d:n], **common,
            total_k_bound=md.prefill_total_k, **self._descales(layer, md.block_table.shape[0] - d, quantized_query),
        )
        return output

    def _descales(self, layer: torch.nn.Module, num_seqs: int, quantized_query: bool = False) -> dict:
        """An FP8 cache's descales as FLASH_ATTN passes them: the layer's scales (per tensor) expanded to
        [num_seqs, num_kv_heads], no copy; q_descale where vLLM quantized the query."""
        if not self.fp8_cache:
            return {}
        shape = (num_seqs, self.num_kv_heads)
        scales = {"k_descale": layer._k_scale, "v_descale": layer._v_scale}
        if quantized_query:
            scales["q_descale"] = layer._q_scale
        return {name: x.float().reshape(1, 1).expand(shape) for name, x in scales.items()}

    def _forward_encoder_only(self, query, key, value, md: TKAttentionMetadata, output, sinks) -> torch.Tensor:
        """Each prompt attends over its own keys, bidirectionally (no cache: the batch holds whole prompts)."""
        n = md.num_actual_tokens
        flash_attn_varlen_func(
            query[:n], key[:n], value[:n], md.query_start_loc, md.query_start_loc, md.max_query_len,
            md.max_query_len, softmax_scale=self.scale, causal=False, window_size=self.window_size,
            softcap=self.softcap, out=output[:n], sinks=sinks,
        )
        return output
