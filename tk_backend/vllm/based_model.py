"""Based (arXiv 2402.18668) for vLLM: an out-of-tree hybrid model whose recurrent state lives in vLLM's state cache.

Registered by the plugin (`tk_backend.vllm.register_models`) as "BasedForCausalLM"; reads the checkpoints of
tk_backend.models.BasedForCausalLM (transformers), same weight names. The three mixers:

* Taylor linear attention (`BasedLinearAttention`): a Mamba-like layer of vLLM's "linear_attention" kind (the
  metadata of LinearAttentionBackend: decodes first, then prefills, one state slot per request). Its state per
  slot is ONE float32 tensor [heads, 1 + 16 + 256, Dv + 1]: rows 0 / 1..16 / 17..272 are the zeroth / first /
  second moments of tk_backend.reference.BasedState. Prefills run `parallel_based` per request, from the slot's
  state when the request has context (a later chunk of a chunked prefill) or from zero, and write the final
  state back; decodes gather their slots, run `based_step` in place on the gathered copy, and scatter it back.
  It is called through vLLM's own `vllm::linear_attention` op (which dispatches to the layer's `_forward` by
  layer name, as MiniMax's layer is), so torch.compile splits the graph there and decode batches can be
  captured in full CUDA graphs (nothing in the decode path syncs with the host).
* Sliding-window attention (`BasedSlidingAttention`): vLLM's `Attention` with `per_layer_sliding_window`, so it
  runs on the selected attention backend (`--attention-backend TK`: tk_backend's prefill / paged decode ops).
* BaseConv (`BasedShortConv`): a Mamba-like layer of vLLM's "short_conv" kind, called through
  `vllm::short_conv`, its convolution state in the state cache, computed by vLLM's causal_conv1d kernels.

Not supported (refused at construction): speculative decoding, and `--mamba-cache-mode all`. Prefix caching in
"align" mode has copy functions (whole-slot copies) but has not been run.
"""
from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba import short_conv as _vllm_short_conv  # noqa: F401 (registers vllm::short_conv)
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.linear import minimax_linear_attn as _vllm_linear  # noqa: F401 (vllm::linear_attention)
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    get_temporal_copy_spec,
    is_conv_state_dim_first,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from tk_backend import based
from tk_backend.reference import BasedState

ARCHITECTURE = "BasedForCausalLM"
MOMENT_ROWS = 1 + based.FEATURE_DIM + based.FEATURE_DIM**2  # zeroth, first, second moments of the keys


# ----------------------------------------------------------------------------- vLLM 0.26 / 0.33 differences
# Everything this file touches exists with the same meaning in both releases (checked in their sources):
# MambaBase (0.33 adds bind_kv_cache, which unpacks the same per-layer state tuple), LinearAttentionMetadata's
# fields, the short-conv metadata's *_p / *_d fields, the vllm::linear_attention and vllm::short_conv ops,
# MambaStateShapeCalculator.short_conv_state_shape (0.33 adds num_spec, default 0) and the IsHybrid
# classmethods (0.33 derives get_mamba_state_copy_funcs from get_mamba_state_copy_func). The only
# difference handled is how a layer finds its metadata: 0.33 may leave a layer out of the dict.


def layer_metadata(prefix: str):
    """This layer's attention metadata, or None in a profile / dummy run."""
    attn_metadata = get_forward_context().attn_metadata
    if attn_metadata is None:
        return None
    if isinstance(attn_metadata, list):  # ubatching hands one dict per micro-batch; we run without it
        raise NotImplementedError("Based does not support micro-batching (dual-batch overlap)")
    return attn_metadata.get(prefix)


# --------------------------------------------------------------------------------------------- state layout


def linear_state_shape(config, tp_size: int) -> tuple[int, int, int]:
    heads = config.linear_attn_num_heads
    if heads % tp_size:
        raise ValueError(f"linear_attn_num_heads ({heads}) must be divisible by the tensor parallel size ({tp_size})")
    return (heads // tp_size, MOMENT_ROWS, config.linear_attn_head_dim + 1)


def unpack_moments(slots: torch.Tensor) -> BasedState:
    """[B, H, 273, W] (one state per request) -> a contiguous BasedState (copies; the kernels update these)."""
    b, h, _, w = slots.shape
    f = based.FEATURE_DIM
    return BasedState(
        zeroth=slots[:, :, 0].contiguous(),
        first=slots[:, :, 1:1 + f].contiguous(),
        second=slots[:, :, 1 + f:].reshape(b, h, f, f, w).contiguous(),
    )


def pack_moments(state: BasedState) -> torch.Tensor:
    """The inverse of unpack_moments."""
    return torch.cat([state.zeroth[:, :, None], state.first, state.second.flatten(2, 3)], dim=2)


def prefill_layout(md) -> list[tuple[int, int, int, bool]]:
    """(token start, token end, state slot, has context) of each prefill request, read from the device once per
    step and kept on the metadata object (every linear-attention layer of the step shares it)."""
    cached = getattr(md, "_tk_based_prefills", None)
    if cached is not None:
        return cached
    nd, np_ = md.num_decodes, md.num_prefills
    starts = md.query_start_loc[nd:nd + np_ + 1].tolist()
    seq_lens = md.seq_lens[nd:nd + np_].tolist()
    slots = md.state_indices_tensor[nd:nd + np_].tolist()
    layout = [(s, e, slot, seq_len > e - s) for s, e, slot, seq_len in zip(starts[:-1], starts[1:], slots, seq_lens)]
    md._tk_based_prefills = layout
    return layout


# ------------------------------------------------------------------------------------------------ mixers



def _register_state_layer(layer, prefix: str, vllm_config) -> None:
    """What vLLM expects of a layer with recurrent state (as its MambaBase layers do): its configs, an empty
    kv_cache until the engine binds one, and an entry under its name in the forward context."""
    layer.prefix = prefix
    layer.model_config = vllm_config.model_config
    layer.cache_config = vllm_config.cache_config
    layer.kv_cache = (torch.tensor([]),)
    context = get_current_vllm_config().compilation_config.static_forward_context
    if prefix in context:
        raise ValueError(f"Duplicate layer name: {prefix}")
    context[prefix] = layer

class BasedLinearAttention(nn.Module, MambaBase):
    """Taylor linear attention (feature dim 16) with its moments in vLLM's state cache."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.state_shape = linear_state_shape(config, tp_size)
        self.num_heads, self.feature_dim = self.state_shape[0], config.linear_attn_feature_dim
        self.head_dim = config.linear_attn_head_dim
        if self.feature_dim != based.FEATURE_DIM:
            raise ValueError(f"linear_attn_feature_dim must be {based.FEATURE_DIM}, got {self.feature_dim}")
        if self.head_dim not in based.VALUE_DIMS:
            raise ValueError(f"hidden_size / linear_attn_num_heads must be one of {based.VALUE_DIMS}, got {self.head_dim}")
        self.use_norm = config.linear_attn_use_norm
        heads, hidden = config.linear_attn_num_heads, config.hidden_size
        quant = vllm_config.quant_config
        self.proj_q = ColumnParallelLinear(hidden, heads * self.feature_dim, bias=False, quant_config=quant,
                                           prefix=f"{prefix}.proj_q")
        self.proj_k = ColumnParallelLinear(hidden, heads * self.feature_dim, bias=False, quant_config=quant,
                                           prefix=f"{prefix}.proj_k")
        self.proj_v = ColumnParallelLinear(hidden, heads * self.head_dim, bias=False, quant_config=quant,
                                           prefix=f"{prefix}.proj_v")
        self.out_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=False, quant_config=quant,
                                          prefix=f"{prefix}.out_proj")
        _register_state_layer(self, prefix, vllm_config)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self) -> tuple[tuple[int, int, int]]:
        return (self.state_shape,)

    def get_state_dtype(self) -> tuple[torch.dtype]:
        return (torch.float32,)  # the kernels accumulate and keep the moments in float32

    def forward(self, hidden_states: torch.Tensor, output: torch.Tensor, positions: torch.Tensor) -> None:
        torch.ops.vllm.linear_attention(hidden_states, output, positions, self.prefix)

    def _forward(self, hidden_states: torch.Tensor, output: torch.Tensor, positions: torch.Tensor) -> None:
        md = layer_metadata(self.prefix)
        tokens = hidden_states.shape[0] if md is None else md.num_decode_tokens + md.num_prefill_tokens
        x = hidden_states[:tokens]
        q = self.proj_q(x)[0].view(tokens, self.num_heads, self.feature_dim)
        k = self.proj_k(x)[0].view(tokens, self.num_heads, self.feature_dim)
        v = self.proj_v(x)[0].view(tokens, self.num_heads, self.head_dim)
        if md is None:  # profile run: shapes only
            o = v
        else:
            o = torch.empty_like(v)
            cache = self.kv_cache[0]  # [num_slots, H, 273, Dv + 1] float32
            nd = md.num_decode_tokens
            if md.num_decodes > 0:
                # Padded CUDA-graph rows point at slot 0 (vLLM's null block) or PAD_SLOT_ID: they read the null
                # block and write back what they read. The null block is shared: in a hybrid model the same
                # memory is the null page of other layers' caches, so it is never written with a state.
                index = md.state_indices_tensor[:md.num_decodes]
                slots = index.clamp(min=0).long()
                before = cache[slots]
                state = unpack_moments(before)
                o[:nd], state = based.based_step(q[:nd], k[:nd], v[:nd], state, use_norm=self.use_norm, inplace=True)
                cache[slots] = torch.where((index > 0).view(-1, 1, 1, 1), pack_moments(state), before)
            for start, end, slot, has_context in prefill_layout(md) if md.num_prefills > 0 else ():
                initial = unpack_moments(cache[slot:slot + 1]) if has_context else None
                o_p, final = based.parallel_based(q[None, start:end], k[None, start:end], v[None, start:end],
                                                  use_norm=self.use_norm, initial_state=initial,
                                                  output_final_state=True)
                o[start:end] = o_p[0]
                cache[slot] = pack_moments(final)[0]
        output[:tokens] = self.out_proj(o.reshape(tokens, -1))[0]


class BasedShortConv(nn.Module, MambaBase):
    """BaseConv: in_proj -> [u | gate], silu(causal depthwise conv(u)) * gate, out_proj; conv state cached."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.conv_dim, self.kernel = config.conv_dim, config.conv_kernel
        quant = vllm_config.quant_config
        self.in_proj = MergedColumnParallelLinear(config.hidden_size, [self.conv_dim] * 2, bias=config.conv_bias,
                                                  quant_config=quant, prefix=f"{prefix}.in_proj")
        self.conv = ColumnParallelLinear(self.kernel, self.conv_dim, bias=False, prefix=f"{prefix}.conv")
        # nn.Conv1d's [dim, 1, kernel] weight layout, so the checkpoint loads as it is (as vLLM's ShortConv does)
        self.conv.weight.data = self.conv.weight.data.unsqueeze(1)
        self.out_proj = RowParallelLinear(self.conv_dim, config.hidden_size, bias=config.conv_bias, quant_config=quant,
                                          prefix=f"{prefix}.out_proj")
        _register_state_layer(self, prefix, vllm_config)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.SHORT_CONV

    def get_state_shape(self) -> tuple[tuple[int, int]]:
        return MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=get_tensor_model_parallel_world_size(), intermediate_size=self.conv_dim,
            conv_kernel=self.kernel)

    def get_state_dtype(self) -> tuple[torch.dtype]:
        return MambaStateDtypeCalculator.short_conv_state_dtype(self.model_config.dtype,
                                                                self.cache_config.mamba_cache_dtype)

    def forward(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        torch.ops.vllm.short_conv(hidden_states, output, self.prefix)

    def forward_native(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        raise NotImplementedError("Based serves on CUDA only (tk_backend's kernels need an sm_90 GPU)")

    def forward_cuda(self, hidden_states: torch.Tensor, output: torch.Tensor) -> None:
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update

        md = layer_metadata(self.prefix)
        u, gate = self.in_proj(hidden_states)[0].chunk(2, dim=-1)
        weight = self.conv.weight.view(self.conv.weight.size(0), self.conv.weight.size(2))
        if md is None:  # profile run: shapes only
            output[: hidden_states.shape[0]] = self.out_proj(u * gate)[0]
            return
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        nd, npt = md.num_decode_tokens, md.num_prefill_tokens
        u_d, u_p = torch.split(u[: nd + npt], [nd, npt], dim=0)
        gate_d, gate_p = torch.split(gate[: nd + npt], [nd, npt], dim=0)
        parts = []
        if nd > 0:  # vLLM orders decodes first
            y = causal_conv1d_update(u_d.contiguous(), conv_state, weight, None, activation="silu",
                                     conv_state_indices=md.state_indices_tensor_d)
            parts.append(y * gate_d)
        if md.num_prefills > 0:
            y = causal_conv1d_fn(u_p.transpose(0, 1), weight, None, activation="silu", conv_states=conv_state,
                                 has_initial_state=md.has_initial_states_p, cache_indices=md.state_indices_tensor_p,
                                 metadata=md, query_start_loc=md.query_start_loc_p).transpose(0, 1)[:npt]
            parts.append(y * gate_p)
        output[: nd + npt] = self.out_proj(torch.cat(parts) if len(parts) > 1 else parts[0])[0]


class BasedSlidingAttention(nn.Module):
    """Softmax attention over the last sliding_window tokens, rotary (NeoX), on vLLM's attention backend."""

    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        quant = vllm_config.quant_config
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=False, quant_config=quant,
                                          prefix=f"{prefix}.qkv_proj")
        self.out_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False,
                                          quant_config=quant, prefix=f"{prefix}.out_proj")
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=vllm_config.cache_config, quant_config=quant,
                              per_layer_sliding_window=config.sliding_window, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states)[0].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.out_proj(self.attn(q, k, v))[0]


class BasedMLP(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        quant = vllm_config.quant_config
        self.fc1 = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                              quant_config=quant, prefix=f"{prefix}.fc1")
        self.act = SiluAndMul()
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False, quant_config=quant,
                                     prefix=f"{prefix}.fc2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)[0]))[0]


class BasedBlock(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.kind = config.mixer_types[extract_layer_index(prefix)]
        mixer = {"conv": BasedShortConv, "linear_attention": BasedLinearAttention,
                 "sliding_attention": BasedSlidingAttention}[self.kind]
        self.norm1 = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = mixer(config, vllm_config, prefix=f"{prefix}.mixer")
        self.norm2 = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = BasedMLP(config, vllm_config, prefix=f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            residual, hidden_states = hidden_states, self.norm1(hidden_states)
        else:
            hidden_states, residual = self.norm1(hidden_states, residual)
        if self.kind == "sliding_attention":
            mixed = self.mixer(positions, hidden_states)
        else:
            mixed = torch.empty_like(hidden_states)
            if self.kind == "linear_attention":
                self.mixer(hidden_states, mixed, positions)
            else:
                self.mixer(hidden_states, mixed)
        hidden_states, residual = self.norm2(mixed, residual)
        return self.mlp(hidden_states), residual


# Explicit dims: with postponed annotations the decorator cannot read the forward's tensor arguments.
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0,
                                         "inputs_embeds": 0})
class BasedModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda prefix: BasedBlock(config, vllm_config, prefix), prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if get_pp_group().is_last_rank \
            else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class BasedForCausalLM(nn.Module, HasInnerState, IsHybrid):
    @classmethod
    def _largest_state(cls, vllm_config: VllmConfig) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
        """vLLM sizes one page per state slot for every recurrent layer from these: the largest layer's state
        (linear attention's float32 moments when the model has any, else the conv state)."""
        config = vllm_config.model_config.hf_config
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        has_linear = "linear_attention" in config.mixer_types
        linear = ((linear_state_shape(config, tp_size),), (torch.float32,)) if has_linear else None
        conv = (MambaStateShapeCalculator.short_conv_state_shape(
                    tp_world_size=tp_size, intermediate_size=config.conv_dim, conv_kernel=config.conv_kernel),
                MambaStateDtypeCalculator.short_conv_state_dtype(vllm_config.model_config.dtype,
                                                                 vllm_config.cache_config.mamba_cache_dtype))
        if not has_linear:
            return conv

        def nbytes(shapes_dtypes):
            return sum(torch.Size(s).numel() * d.itemsize for s, d in zip(*shapes_dtypes))

        return max(linear, conv, key=nbytes) if "conv" in config.mixer_types else linear

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return cls._largest_state(vllm_config)[0]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return cls._largest_state(vllm_config)[1]

    @classmethod
    def get_mamba_state_copy_func(cls):
        # Each recurrent layer keeps one state tensor per slot; without speculative decoding a whole-slot copy
        # is right for both kinds (the conv state of one accepted token is the whole slot).
        return (get_temporal_copy_spec,)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        if vllm_config.speculative_config is not None:
            raise NotImplementedError("Based does not support speculative decoding")
        if vllm_config.cache_config.mamba_cache_mode == "all":
            raise NotImplementedError("Based does not support --mamba-cache-mode all (use align, or no prefix caching)")
        self.config = config
        self.model = BasedModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self, skip_prefixes=["lm_head."] if self.config.tie_word_embeddings else None)
        return loader.load_weights(weights)


__all__ = ["ARCHITECTURE", "BasedForCausalLM", "MOMENT_ROWS", "pack_moments", "unpack_moments"]
