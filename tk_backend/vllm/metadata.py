"""Per-step attention metadata for the TK backend: which op a batch goes through, and with what.

A batch whose requests all have the same query length q <= tk_backend.attention.MAX_DECODE_Q_LEN (plain
decode: q = 1; speculative verification: q = 1 + drafts) runs through paged decode (`attention.PagedDecode`,
one plan a step that every layer runs: DecodeStep), whose split-KV plan depends only on the batch shape (batch, q,
block-table width), so the step can be captured once per batch size in a CUDA graph and replayed for any context
lengths. Everything else (prefill, chunked prefill, prefix-cache hits) runs through the paged
`flash_attn_varlen_func`. A mixed batch is split: the builder asks vLLM to put single-token requests first
(reorder_batch_threshold = 1), and when at least MIN_SPLIT_DECODES of them lead the batch they run through paged
decode (a kv head's query heads share one tile and one read of its keys) and only the rest through the prefill
kernel, whose 128-row query tiles a one-token request would mostly leave empty, once per query head.

Padding: when vLLM replays a full CUDA graph it pads the batch with requests of query length 0 and context
length 0 at the end. Those keep a batch uniform (the decode op gives a zero-length sequence no work).

Bidirectional attention: a batch whose CommonAttentionMetadata says causal=False (a non-causal decoder, e.g. a
DFlash drafter) runs through the same two ops with causal=False. Encoder-only layers (BERT-like embedding models:
vLLM's EncoderOnlyAttention, whose builder subclass sets causal=False) have no KV cache: their builder gets an
EncoderOnlyAttentionSpec, vLLM hands it a one-column block table of zeros and a slot mapping of zeros, and the
batch is all whole prompts; the builder then makes no decode plan and the impl attends over the batch's own
keys (backend.py). A per-sequence causal tensor (a batch mixing causal and bidirectional sequences) is refused.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

from tk_backend.attention import (
    DEFAULT_DECODE_WORKSPACES,
    FP8_CACHE_DTYPES,
    MAX_DECODE_Q_LEN,
    MAX_DECODE_ROWS,
    DecodeWorkspacePool,
    PagedDecode,
)
from tk_backend.vllm import compat


def step_block_table(block_table: torch.Tensor, max_seq_len: int, block_size: int) -> torch.Tensor:
    """The columns of vLLM's block table an eager step reads. The table is max_model_len wide, and the decode
    planner sizes its split for the table's width (docs/findings/serving.md#step-block-table), so an eager step
    (mixed batches under piecewise CUDA graphs, or no graphs) passes only the pages max_seq_len needs, rounded up
    to a power of two so that few plans are made (make_plan is cached). A step being captured keeps the full width
    (DecodeStep.run): the captured plan must hold every later replay's contexts."""
    pages = max(-(-max_seq_len // block_size), 1)
    width = 1 << (pages - 1).bit_length()
    return block_table[:, :width] if width < block_table.shape[1] else block_table


class DecodeStep:
    """A step's decode requests (a uniform batch, or a mixed batch's leading one-token requests) as its layers run
    them: build() makes it, the step's first layer of each configuration plans an attention.PagedDecode, and the
    configuration's other layers run that plan, reusing the schedule its first run works out.

    A plan needs what only forward sees: the layer's heads and window, the cache's page size (vLLM's kernel block
    size, which may divide the KV manager's), and whether the run is being captured into a CUDA graph, which reads
    the whole block table where an eager run reads step_block_table's columns (so the two modes plan apart)."""

    def __init__(self, seq_lens: torch.Tensor, block_table: torch.Tensor, max_seq_len: int, q_len: int,
                 workspaces: DecodeWorkspacePool, plans: dict | None = None, causal: bool = True,
                 total_k_bound: int = 0) -> None:
        self.seq_lens = seq_lens  # int32 [batch], device
        self.block_table = block_table  # int32 [batch, max_blocks], device
        self.max_seq_len = max_seq_len
        self.total_k_bound = total_k_bound  # > 0: a bound on sum(seq_lens) (an FP8 cache's fallback scratch)
        self.q_len = q_len
        self.workspaces = workspaces
        self.causal = causal
        self._plans: dict[tuple, PagedDecode] = {} if plans is None else plans

    def with_block_table(self, block_table: torch.Tensor) -> "DecodeStep":
        """The step over another KV-cache group's block table of the same shape (update_block_table): the same
        plans and schedules, which depend on the table's width, not its pages."""
        return DecodeStep(self.seq_lens, block_table, self.max_seq_len, self.q_len, self.workspaces, self._plans,
                          self.causal, self.total_k_bound)

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor, *,
            softmax_scale: float, window_size: tuple[int, int], softcap: float,
            sinks: torch.Tensor | None = None, q_descale: torch.Tensor | None = None,
            k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None) -> None:
        """One layer: query / output [batch * q_len, heads, head_size], the step's decode rows (request-major);
        sinks: the layer's attention sinks (float32 [heads]) or None; q / k / v_descale: an FP8 cache's [batch,
        kv_heads] scales."""
        shape = (self.seq_lens.shape[0], self.q_len, query.shape[1], query.shape[2])
        page_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        captured = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        table = self.block_table if captured else step_block_table(self.block_table, self.max_seq_len, page_size)
        config = (shape[2:], page_size, num_kv_heads, window_size, captured, key_cache.dtype)
        decode = self._plans.get(config)
        if decode is None:
            decode = self._plans[config] = PagedDecode(self.workspaces).plan(
                self.seq_lens, table, num_q_heads=shape[2], num_kv_heads=num_kv_heads, head_dim=shape[3],
                page_size=page_size, q_len=self.q_len, causal=self.causal, window_size=window_size,
                kv_cache_dtype=key_cache.dtype, total_k_bound=0 if captured else self.total_k_bound,
            )
        decode.run(query.view(shape), key_cache, value_cache, output.view(shape), softmax_scale=softmax_scale,
                   softcap=softcap, block_table=table, sinks=sinks, q_descale=q_descale, k_descale=k_descale,
                   v_descale=v_descale)


@dataclasses.dataclass
class TKAttentionMetadata:
    num_actual_tokens: int  # tokens of real requests (query rows past it are padding)
    max_query_len: int
    max_seq_len: int  # an upper bound on every context length
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    seq_lens: torch.Tensor  # int32 [num_reqs], device: context length including the new tokens
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks], device
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], device
    # > 0: the batch is decode_batch requests of decode_query_len tokens each (trailing padding requests
    # included), laid out request-major in the first decode_batch * decode_query_len query rows.
    decode_batch: int = 0
    decode_query_len: int = 0
    # > 0 (mixed batches only): the first num_decodes requests have one query token each and go through the
    # decode op; the others through the prefill op with prefill_query_start_loc (query_start_loc[num_decodes:]
    # shifted to start at 0).
    num_decodes: int = 0
    prefill_query_start_loc: torch.Tensor | None = None
    # The decode requests' (uniform batches: all; mixed: the first num_decodes), as every layer runs them.
    decode: DecodeStep | None = None
    # False: bidirectional attention (a non-causal decoder, or an encoder-only layer's batch).
    causal: bool = True
    # FP8 caches, eager batches: a host-known bound on the prefill requests' keys (their sum), which sizes the
    # dequantized scratch (flash_attn_varlen_func's total_k_bound); 0: none known.
    prefill_total_k: int = 0

    @property
    def is_uniform_decode(self) -> bool:
        return self.decode_batch > 0


# A mixed batch's leading single-token requests go through the decode op when there are at least this many;
# fewer cost the prefill kernel little, next to the decode op's three launches. An estimate, not yet tuned.
MIN_SPLIT_DECODES = 8


def is_fp8_spec(kv_cache_spec) -> bool:
    """Whether a KV-cache spec holds FP8 (e4m3) entries (vLLM allocates them as uint8)."""
    return getattr(kv_cache_spec, "dtype", None) in FP8_CACHE_DTYPES


def _leading(lens, q_len: int) -> int:
    """How many of the (numpy) query lengths `lens` at the front equal q_len."""
    others = (lens != q_len).nonzero()[0]
    return int(others[0]) if others.size else int(lens.size)


def _query_lens(query_start_loc_cpu: torch.Tensor):
    """The requests' query lengths from the host copy of query_start_loc (numpy: no sync, a few microseconds)."""
    starts = query_start_loc_cpu.numpy()
    return starts[1:] - starts[:-1]


def leading_single_token_requests(query_start_loc_cpu: torch.Tensor) -> int:
    """How many requests at the front of the batch have exactly one query token (host copy: no sync)."""
    return _leading(_query_lens(query_start_loc_cpu), 1)


def uniform_decode_shape(query_start_loc_cpu: torch.Tensor, max_query_len: int) -> tuple[int, int] | None:
    """(batch, q_len) if every request has q_len = max_query_len <= MAX_DECODE_Q_LEN tokens, padding requests
    of 0 tokens allowed only at the end; None otherwise. Reads the host copy of query_start_loc: no sync.
    Runs every step on the host (numpy: a few microseconds, where torch's CPU ops took ~20)."""
    q_len = int(max_query_len)
    if not 1 <= q_len <= MAX_DECODE_Q_LEN:
        return None
    lens = _query_lens(query_start_loc_cpu)
    if lens.size == 0:
        return None
    num_full = _leading(lens, q_len)  # leading requests of exactly q_len tokens
    if num_full == 0 or lens[num_full:].any():
        return None
    return int(lens.size), q_len


def batch_causality(causal: object) -> bool:
    """CommonAttentionMetadata.causal as the TK ops take it: one bool for the whole batch."""
    if isinstance(causal, torch.Tensor):
        raise NotImplementedError(
            f"the TK attention backend takes one causal flag per batch, got a per-sequence causal tensor of shape "
            f"{tuple(causal.shape)} (a batch mixing causal and bidirectional sequences); TK runs a batch either causal "
            "or bidirectional: choose another backend for this model, for example --attention-backend TRITON_ATTN"
        )
    return bool(causal)


class TKAttentionMetadataBuilder(AttentionMetadataBuilder[TKAttentionMetadata]):
    # Full CUDA graphs for uniform batches (decode, spec-decode verification); other batches run attention
    # eagerly between piecewise graphs. Varlen prefill sizes its grid from max_seqlen_q/k on the host, so a
    # graph of it would not replay correctly for longer sequences.
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    supports_update_block_table = True
    reorder_batch_threshold = 1  # single-token requests first: mixed batches split (module docstring)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        q_len = compat.max_decode_query_len(vllm_config)
        if q_len > MAX_DECODE_Q_LEN:
            # Verification batches are too wide for the decode op: only plain decode batches can be graphed.
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        if is_fp8_spec(kv_cache_spec) and q_len * compat.query_group(vllm_config, kv_cache_spec) > MAX_DECODE_ROWS:
            # Over an FP8 cache these run on the prefill kernel's scratch, which a graph would size for every
            # table column: they run eagerly, where the CPU lengths bound it.
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        # Encoder-only layers (module docstring): no KV cache, no decode plans.
        self.encoder_only = isinstance(kv_cache_spec, EncoderOnlyAttentionSpec)
        self.fp8_cache = is_fp8_spec(kv_cache_spec)
        # One pool for every builder, as every layout's workspace serves any batch size.
        self.decode_workspaces = DEFAULT_DECODE_WORKSPACES

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TKAttentionMetadata:
        cm = common_attn_metadata
        causal = batch_causality(cm.causal)
        num_reqs = cm.num_reqs
        if self.encoder_only:
            return TKAttentionMetadata(
                num_actual_tokens=cm.num_actual_tokens,
                max_query_len=cm.max_query_len,
                max_seq_len=cm.max_seq_len,
                query_start_loc=cm.query_start_loc[: num_reqs + 1],
                seq_lens=cm.seq_lens[:num_reqs],
                block_table=cm.block_table_tensor[:num_reqs],
                slot_mapping=cm.slot_mapping,
                causal=False,
            )
        shape = uniform_decode_shape(cm.query_start_loc_cpu[: num_reqs + 1], cm.max_query_len)
        decode_batch, decode_query_len = shape if shape is not None else (0, 0)
        num_decodes, prefill_query_start_loc = 0, None
        if shape is None:
            num_decodes = leading_single_token_requests(cm.query_start_loc_cpu[: num_reqs + 1])
            if MIN_SPLIT_DECODES <= num_decodes < num_reqs:
                prefill_query_start_loc = cm.query_start_loc[num_decodes: num_reqs + 1] - num_decodes
            else:
                num_decodes = 0
        seq_lens, block_table = cm.seq_lens[:num_reqs], cm.block_table_tensor[:num_reqs]
        bounds = getattr(cm, "seq_lens_cpu_upper_bound", None) if self.fp8_cache else None

        def keys(lo: int, hi: int) -> int:  # the requests' keys from the CPU bounds (0: none known)
            return int(bounds[lo:hi].sum()) if bounds is not None else 0

        decode = None
        if shape is not None:
            decode = DecodeStep(seq_lens, block_table, cm.max_seq_len, decode_query_len, self.decode_workspaces,
                                causal=causal, total_k_bound=keys(0, num_reqs))
        elif num_decodes > 0:
            decode = DecodeStep(seq_lens[:num_decodes], block_table[:num_decodes], cm.max_seq_len, 1,
                                self.decode_workspaces, causal=causal)
        return TKAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc[: num_reqs + 1],
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=cm.slot_mapping,
            decode_batch=decode_batch,
            decode_query_len=decode_query_len,
            num_decodes=num_decodes,
            prefill_query_start_loc=prefill_query_start_loc,
            decode=decode,
            causal=causal,
            prefill_total_k=keys(num_decodes, num_reqs) if shape is None else 0,
        )

    def update_block_table(
        self, metadata: TKAttentionMetadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> TKAttentionMetadata:
        updated = copy.copy(metadata)
        updated.block_table = blk_table[: metadata.block_table.shape[0]]
        updated.slot_mapping = slot_mapping
        if metadata.decode is not None:
            rows = metadata.decode.block_table.shape[0]
            updated.decode = metadata.decode.with_block_table(updated.block_table[:rows])
        return updated
