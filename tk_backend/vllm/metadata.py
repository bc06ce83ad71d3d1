"""Per-step attention metadata for the TK backend: which op a batch goes through, and with what.

A batch whose requests all have the same query length q <= tk_backend.attention.MAX_DECODE_Q_LEN (plain
decode: q = 1; speculative verification: q = 1 + drafts) runs through `flash_attn_with_kvcache`, whose split-KV
plan depends only on the batch shape (batch, q, block-table width), so the call can be captured once per
batch size in a CUDA graph and replayed for any context lengths. Everything else (prefill, chunked prefill,
prefix-cache hits) runs through the paged `flash_attn_varlen_func`. A mixed batch is split: the builder asks vLLM
to put single-token requests first (reorder_batch_threshold = 1), and when at least MIN_SPLIT_DECODES of them
lead the batch they run through `flash_attn_with_kvcache` (a kv head's query heads share one tile and one read
of its keys) and only the rest through the prefill kernel, whose 128-row query tiles a one-token request
would mostly leave empty, once per query head.

Padding: when vLLM replays a full CUDA graph it pads the batch with requests of query length 0 and context
length 0 at the end. Those keep a batch uniform (the decode op gives a zero-length sequence no work).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools

import torch
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from tk_backend.attention import MAX_DECODE_Q_LEN
from tk_backend.vllm import compat


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
    # One a build (a step): the decode op's schedule_token, so the step's layers build its work list once.
    schedule_token: int = -1

    @property
    def is_uniform_decode(self) -> bool:
        return self.decode_batch > 0


# Each build's schedule_token (a fresh one a step, whichever builder builds it).
_schedule_tokens = itertools.count()

# A mixed batch's leading single-token requests go through the decode op when there are at least this many;
# fewer cost the prefill kernel little, next to the decode op's three launches. An estimate, not yet tuned.
MIN_SPLIT_DECODES = 8


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


class TKAttentionMetadataBuilder(AttentionMetadataBuilder[TKAttentionMetadata]):
    # Full CUDA graphs for uniform batches (decode, spec-decode verification); other batches run attention
    # eagerly between piecewise graphs. Varlen prefill sizes its grid from max_seqlen_q/k on the host, so a
    # graph of it would not replay correctly for longer sequences.
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH
    supports_update_block_table = True
    reorder_batch_threshold = 1  # single-token requests first: mixed batches split (module docstring)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if compat.max_decode_query_len(vllm_config) > MAX_DECODE_Q_LEN:
            # Verification batches are too wide for the decode op: only plain decode batches can be graphed.
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TKAttentionMetadata:
        cm = common_attn_metadata
        if cm.causal is not True:
            raise NotImplementedError("the TK attention backend runs causal decoder attention only")
        num_reqs = cm.num_reqs
        shape = uniform_decode_shape(cm.query_start_loc_cpu[: num_reqs + 1], cm.max_query_len)
        decode_batch, decode_query_len = shape if shape is not None else (0, 0)
        num_decodes, prefill_query_start_loc = 0, None
        if shape is None:
            num_decodes = leading_single_token_requests(cm.query_start_loc_cpu[: num_reqs + 1])
            if MIN_SPLIT_DECODES <= num_decodes < num_reqs:
                prefill_query_start_loc = cm.query_start_loc[num_decodes: num_reqs + 1] - num_decodes
            else:
                num_decodes = 0
        return TKAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc[: num_reqs + 1],
            seq_lens=cm.seq_lens[:num_reqs],
            block_table=cm.block_table_tensor[:num_reqs],
            slot_mapping=cm.slot_mapping,
            decode_batch=decode_batch,
            decode_query_len=decode_query_len,
            num_decodes=num_decodes,
            prefill_query_start_loc=prefill_query_start_loc,
            schedule_token=next(_schedule_tokens),
        )

    def update_block_table(
        self, metadata: TKAttentionMetadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> TKAttentionMetadata:
        updated = copy.copy(metadata)
        updated.block_table = blk_table[: metadata.block_table.shape[0]]
        updated.slot_mapping = slot_mapping
        return updated
