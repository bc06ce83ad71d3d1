"""transformers integration: `attn_implementation="tk"` runs a model's attention through tk_backend's ops.

    import tk_backend.hf  # registers "tk"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="tk", dtype=torch.bfloat16)

Registers two things under the name "tk":
* an attention function (AttentionInterface): batches without padding go through `flash_attn_func`; padded
  batches are unpadded with the 2D mask and go through `flash_attn_varlen_func`, as are packed sequences
  (several sequences in one row, told apart by position_ids restarting at 0) and models that pass cu_seqlens;
* a mask function (AttentionMaskInterface): flash-attn's, which hands the attention function the 2D padding
  mask (None when nothing is padded) instead of a 4D one. Without it transformers would pass no mask at all.

Causal masks are bottom-right aligned, so decoding with a cache (fewer queries than keys) needs no offsets;
with left padding (what `generate` does) the padded positions are simply dropped. GQA is native to the ops;
sliding windows (Mistral-style `sliding_window`), logit soft-capping (Gemma-2-style `softcap`) and attention sinks
(gpt-oss passes `s_aux=module.sinks`, as to flash-attn; the ops take them as float32, at head dims 64, 128 and
256) are passed through. Attention dropout in training is refused.
"""
from __future__ import annotations

import torch

from tk_backend.attention import flash_attn_func, flash_attn_varlen_func

ATTN_IMPLEMENTATION = "tk"
HALF_TYPES = (torch.bfloat16, torch.float16)


def register() -> None:
    """Register the "tk" attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, tk_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, flash_attention_mask)


def _half_dtype_of(module: torch.nn.Module) -> torch.dtype | None:
    """The 16-bit dtype of the module's weights, to run fp32 activations (e.g. fp32 norms under PEFT) in."""
    for param in module.parameters():
        if param.dtype in HALF_TYPES:
            return param.dtype
    return None


def _window(sliding_window: int | None, key_length: int) -> tuple[int, int]:
    # transformers' sliding window w: a query sees itself and the w - 1 keys before it (symmetric if not causal).
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, sliding_window - 1)


def _packed_cu_seqlens(position_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """cu_seqlens of sequences packed in one row (position_ids restart at 0), or None if not packed."""
    if position_ids is None or batch != 1 or position_ids.shape[-1] < 2:
        return None
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() <= 1 and (starts.numel() == 0 or int(starts[0]) == 0):
        return None  # one sequence (or a continuation): not packed
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    end = torch.tensor([pos.numel()], dtype=starts.dtype, device=starts.device)
    return torch.cat([starts, end]).to(torch.int32)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B * S, H, D]."""
    return t.reshape(-1, t.shape[2], t.shape[3])


def tk_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, Hq, Sq, D], key/value [B, Hkv, Sk, D] -> ([B, Sq, Hq, D], None), as transformers expects.
    s_aux: the layer's attention sinks [Hq] (gpt-oss), any float dtype."""
    if dropout > 0.0 and module.training:
        raise NotImplementedError(f'attn_implementation="tk" does not implement attention dropout (got {dropout})')
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f'attn_implementation="tk" takes a 2D padding mask [batch, keys], got shape {tuple(attention_mask.shape)};'
            ' this happens when the "tk" mask function is not registered (call tk_backend.hf.register())'
        )
    if query.dtype == torch.float32 and (half := _half_dtype_of(module)) is not None:
        query, key, value = query.to(half), key.to(half), value.to(half)

    batch, _, q_len, head_dim = query.shape
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, S, H, D]
    causal = bool(module.is_causal if is_causal is None else is_causal)
    window = _window(sliding_window, k.shape[1])
    sinks = None if s_aux is None else s_aux.to(device=query.device, dtype=torch.float32)
    common = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=float(softcap or 0.0),
                  sinks=sinks)

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if attention_mask is None and cu_q is None:
        cu_q = cu_k = _packed_cu_seqlens(kwargs.get("position_ids"), batch)
    if cu_q is not None and cu_k is not None:  # padding-free: several sequences packed along the length
        out = flash_attn_varlen_func(
            _rows(q), _rows(k), _rows(v), cu_q.to(torch.int32), cu_k.to(torch.int32),
            int(kwargs.get("max_length_q") or batch * q_len), int(kwargs.get("max_length_k") or batch * k.shape[1]),
            **common,
        )
        return out.view(batch, q_len, *out.shape[1:]), None

    if attention_mask is None:
        return flash_attn_func(q, k, v, **common), None

    # Padded batch: keep the keys the mask marks valid and the queries in the last q_len mask columns (the
    # queries are the newest tokens; generate pads on the left). A static cache can hold more keys than the
    # mask covers: those slots are unwritten.
    mask = attention_mask.to(torch.bool)
    if k.shape[1] > mask.shape[1]:
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
    keys = torch.nonzero(mask.flatten()).flatten()
    cu_k = torch.nn.functional.pad(mask.sum(-1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    mask_q = mask[:, -q_len:] if q_len <= mask.shape[1] else torch.ones(batch, q_len, dtype=torch.bool,
                                                                        device=mask.device)
    queries = torch.nonzero(mask_q.flatten()).flatten()
    cu_q = torch.nn.functional.pad(mask_q.sum(-1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    out_unpadded = flash_attn_varlen_func(
        _rows(q)[queries], _rows(k)[keys], _rows(v)[keys], cu_q, cu_k, q_len, mask.shape[1], **common
    )
    out = out_unpadded.new_zeros(batch * q_len, out_unpadded.shape[1], head_dim)
    out[queries] = out_unpadded
    return out.view(batch, q_len, -1, head_dim), None


register()
