"""BasedForCausalLM for transformers: the Based hybrid (see configuration_based.py) on tk_backend's ops.

On a CUDA device with 16-bit weights and the extension built, the mixers run tk_backend's kernels:
`parallel_based` (prefill, continuing from a cached state) and `based_step` (one decode token, state updated
in place) for linear attention, `flash_attn_func` with a left window for sliding-window attention. Anywhere
else (CPU, float32) they run the float32 references below, so the model loads, runs and decodes on CPU.

Decoding keeps its state in `BasedCache` (pass `past_key_values=BasedCache(config)` or `use_cache=True`):
per layer the BaseConv inputs of the last conv_kernel - 1 tokens, the linear-attention moments (`BasedState`,
float32) or the last sliding_window - 1 keys and values. A prefill followed by decode steps equals one long
forward. Padding is refused: a recurrent state cannot skip padded positions, so batch equal-length rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from tk_backend import based
from tk_backend.models.configuration_based import BasedConfig
from tk_backend.reference import BasedState, based_prefill_state

HALF_TYPES = (torch.bfloat16, torch.float16)


def kernels_usable(x: torch.Tensor) -> bool:
    """True when tk_backend's kernels can run on x: a CUDA tensor in a 16-bit dtype, extension built."""
    from tk_backend import extension_available

    return x.is_cuda and x.dtype in HALF_TYPES and extension_available()


# ------------------------------------------------------------------------------------------- references


def based_chunk_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: BasedState | None, use_norm: bool = True,
    eps: float = based.EPS,
) -> tuple[torch.Tensor, BasedState]:
    """Based attention of a chunk continuing from `state`, in float32: q/k [B, N, H, F], v [B, N, H, Dv].

    Returns (o [B, N, H, Dv] in q's dtype, the state after the chunk). With state None this is
    reference.based plus reference.based_prefill_state.
    """
    scale = q.shape[-1] ** -0.5
    qs, kf = q.float() * scale, k.float()
    va = torch.cat([v.float(), v.new_ones(*v.shape[:-1], 1, dtype=torch.float32)], dim=-1)
    s = torch.einsum("bihd,bjhd->bhij", qs, kf)
    n = q.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    w = (1 + s + 0.5 * s * s).masked_fill(~causal, 0.0)
    o = torch.einsum("bhij,bjhe->bihe", w, va)
    chunk_state = based_prefill_state(k, v)
    if state is not None:
        o = (o + state.zeroth[:, None] + torch.einsum("bihk,bhke->bihe", qs, state.first)
             + 0.5 * torch.einsum("bihk,bihl,bhkle->bihe", qs, qs, state.second))
        chunk_state = BasedState(*(a + b for a, b in zip(state, chunk_state)))
    num, den = o[..., :-1], o[..., -1:]
    out = num / (den + eps) if use_norm else num
    return out.to(q.dtype), chunk_state


def window_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float
) -> torch.Tensor:
    """Causal softmax attention in float32, the Nq queries being the last Nq of the Nk keys' positions; a query
    sees itself and the window - 1 keys before it. q [B, Nq, H, D], k/v [B, Nk, Hkv, D] -> [B, Nq, H, D]."""
    nq, nk = q.shape[1], k.shape[1]
    groups = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(groups, dim=2)
    vf = v.float().repeat_interleave(groups, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q.float() * scale, kf)
    qpos = torch.arange(nk - nq, nk, device=q.device)[:, None]
    kpos = torch.arange(nk, device=q.device)[None, :]
    visible = (kpos <= qpos) & (kpos > qpos - window)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("bhij,bjhd->bihd", probs, vf).to(q.dtype)


def rotate_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """GPT-NeoX rotary embedding of x [B, N, H, D] at positions [N] (cos/sin in float32, applied in x's dtype)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos().to(x.dtype)[None, :, None, :], freqs.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ------------------------------------------------------------------------------------------------ cache


class BasedCache:
    """Per-layer decode state of a Based model (not a transformers Cache: Based's state is not keys/values).

    conv[i]: [B, conv_dim, conv_kernel - 1] inputs of BaseConv layer i; linear[i]: its BasedState (float32);
    window[i]: (keys, values) [B, <= sliding_window - 1, Hkv, D]. `seen_tokens` positions the next chunk.
    """

    def __init__(self, config: BasedConfig):
        self.config = config
        self.conv: dict[int, torch.Tensor] = {}
        self.linear: dict[int, BasedState] = {}
        self.window: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.seen_tokens = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens


# ----------------------------------------------------------------------------------------------- layers


class BasedRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class BasedMLP(nn.Module):
    """SwiGLU: fc1 -> [gate | up], fc2(silu(gate) * up)."""

    def __init__(self, config: BasedConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class BasedConv(nn.Module):
    """BaseConv: in_proj -> [u | gate], silu(causal depthwise conv(u)) * gate, out_proj."""

    def __init__(self, config: BasedConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kernel = config.conv_kernel
        dim = config.conv_dim
        self.in_proj = nn.Linear(config.hidden_size, 2 * dim, bias=config.conv_bias)
        self.conv = nn.Conv1d(dim, dim, config.conv_kernel, groups=dim, bias=False)
        self.out_proj = nn.Linear(dim, config.hidden_size, bias=config.conv_bias)

    def forward(self, x: torch.Tensor, cache: BasedCache | None, position_offset: int) -> torch.Tensor:
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        u = u.transpose(1, 2)  # [B, dim, N]
        if cache is not None and self.layer_idx in cache.conv:
            history = cache.conv[self.layer_idx]
        else:
            history = u.new_zeros(u.shape[0], u.shape[1], self.kernel - 1)
        extended = torch.cat([history, u], dim=-1)
        if cache is not None:
            cache.conv[self.layer_idx] = extended[..., extended.shape[-1] - (self.kernel - 1):]
        # float32 accumulation, as vLLM's causal_conv1d kernels do
        y = F.conv1d(extended.float(), self.conv.weight.float(), groups=u.shape[1])
        y = F.silu(y).to(x.dtype).transpose(1, 2)
        return self.out_proj(y * gate)


class BasedLinearAttention(nn.Module):
    """Taylor linear attention (feature dim 16): parallel_based / based_step on CUDA, the reference elsewhere."""

    def __init__(self, config: BasedConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.linear_attn_num_heads
        self.feature_dim = config.linear_attn_feature_dim
        self.head_dim = config.linear_attn_head_dim
        self.use_norm = config.linear_attn_use_norm
        self.proj_q = nn.Linear(config.hidden_size, self.num_heads * self.feature_dim, bias=False)
        self.proj_k = nn.Linear(config.hidden_size, self.num_heads * self.feature_dim, bias=False)
        self.proj_v = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache: BasedCache | None, position_offset: int) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.proj_q(x).view(b, n, self.num_heads, self.feature_dim)
        k = self.proj_k(x).view(b, n, self.num_heads, self.feature_dim)
        v = self.proj_v(x).view(b, n, self.num_heads, self.head_dim)
        state = cache.linear.get(self.layer_idx) if cache is not None else None
        if kernels_usable(q) and self.feature_dim == based.FEATURE_DIM and self.head_dim in based.VALUE_DIMS:
            if n == 1 and state is not None:
                o, state = based.based_step(q[:, 0], k[:, 0], v[:, 0], state, use_norm=self.use_norm, inplace=True)
                o = o[:, None]
            elif cache is not None:
                o, state = based.parallel_based(q, k, v, use_norm=self.use_norm, initial_state=state,
                                                output_final_state=True)
            else:
                o = based.parallel_based(q, k, v, use_norm=self.use_norm)
        else:
            o, state = based_chunk_reference(q, k, v, state, self.use_norm)
        if cache is not None:
            cache.linear[self.layer_idx] = state
        return self.out_proj(o.reshape(b, n, -1))


class BasedSlidingWindowAttention(nn.Module):
    """Softmax attention over a sliding window with rotary positions; tk_backend's flash_attn_func on CUDA."""

    def __init__(self, config: BasedConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.rope_theta = config.rope_theta
        self.scale = self.head_dim**-0.5
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.out_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cache: BasedCache | None, position_offset: int) -> torch.Tensor:
        from tk_backend.attention import HEAD_DIMS, flash_attn_func

        b, n, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        positions = torch.arange(position_offset, position_offset + n, device=x.device)
        q = rotate_neox(q.view(b, n, self.num_heads, self.head_dim), positions, self.rope_theta)
        k = rotate_neox(k.view(b, n, self.num_kv_heads, self.head_dim), positions, self.rope_theta)
        v = v.view(b, n, self.num_kv_heads, self.head_dim)
        if cache is not None:
            if self.layer_idx in cache.window:
                past_k, past_v = cache.window[self.layer_idx]
                k, v = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
            keep = max(0, k.shape[1] - (self.window - 1))
            cache.window[self.layer_idx] = (k[:, keep:], v[:, keep:])
        if kernels_usable(q) and self.head_dim in HEAD_DIMS:
            o = flash_attn_func(q, k, v, softmax_scale=self.scale, causal=True, window_size=(self.window - 1, 0))
        else:
            o = window_attention_reference(q, k, v, self.window, self.scale)
        return self.out_proj(o.reshape(b, n, -1))


MIXERS = {"conv": BasedConv, "linear_attention": BasedLinearAttention,
          "sliding_attention": BasedSlidingWindowAttention}


class BasedBlock(nn.Module):
    def __init__(self, config: BasedConfig, layer_idx: int):
        super().__init__()
        self.norm1 = BasedRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = MIXERS[config.mixer_types[layer_idx]](config, layer_idx)
        self.norm2 = BasedRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = BasedMLP(config)

    def forward(self, x: torch.Tensor, cache: BasedCache | None, position_offset: int) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x), cache, position_offset)
        return x + self.mlp(self.norm2(x))


# ------------------------------------------------------------------------------------------------ models


class BasedPreTrainedModel(PreTrainedModel):
    config_class = BasedConfig
    base_model_prefix = "model"
    _no_split_modules = ["BasedBlock"]
    _is_stateful = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, BasedRMSNorm):
            module.weight.fill_(1.0)


class BasedModel(BasedPreTrainedModel):
    def __init__(self, config: BasedConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BasedBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = BasedRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: BasedCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise NotImplementedError("BasedModel does not support padding (its recurrent state would absorb the "
                                      "padded positions); batch sequences of equal length instead")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = BasedCache(self.config)
        if past_key_values is not None and not isinstance(past_key_values, BasedCache):
            raise TypeError(f"past_key_values must be a BasedCache, got {type(past_key_values).__name__}")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        offset = past_key_values.seen_tokens if past_key_values is not None else 0
        for layer in self.layers:
            x = layer(x, past_key_values, offset)
        if past_key_values is not None:
            past_key_values.seen_tokens += x.shape[1]
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x),
                                       past_key_values=past_key_values if use_cache else None)


class BasedForCausalLM(BasedPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: BasedConfig):
        super().__init__(config)
        self.model = BasedModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: BasedCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)

    @torch.no_grad()
    def greedy(self, input_ids: torch.LongTensor, max_new_tokens: int) -> torch.LongTensor:
        """Greedy continuation: one prefill, then one cached step per token. Returns the new tokens [B, n]."""
        cache = BasedCache(self.config)
        logits = self(input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        tokens = []
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            logits = self(nxt, past_key_values=cache, use_cache=True).logits
        return torch.cat(tokens, dim=1) if tokens else input_ids.new_empty(input_ids.shape[0], 0)


__all__ = ["BasedCache", "BasedForCausalLM", "BasedModel", "BasedPreTrainedModel", "based_chunk_reference",
           "kernels_usable", "window_attention_reference"]
