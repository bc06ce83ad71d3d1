"""BasedConfig (model_type "based"): the hybrid of arXiv 2402.18668, kept light enough to import in vLLM's plugin.

A Based model stacks pre-norm blocks (RMSNorm -> sequence mixer -> residual, RMSNorm -> SwiGLU MLP -> residual)
whose mixers are of three kinds, named per layer in `mixer_types`:

* "linear_attention": Taylor linear attention. q, k are projected to `linear_attn_num_heads` heads of
  `linear_attn_feature_dim` (16), v to heads of hidden_size / linear_attn_num_heads; the kernel is the 2nd-order
  Taylor expansion of exp(q.k / 4), normalised. Its decode state is the float32 moments `BasedState`.
* "sliding_attention": softmax attention over the last `sliding_window` tokens (a query sees itself and the
  sliding_window - 1 tokens before it), rotary positions (GPT-NeoX style, `rope_theta`).
* "conv": BaseConv, a gated short convolution: in_proj to 2 * conv_expand * hidden, a causal depthwise
  convolution of width `conv_kernel` over the first half, SiLU, times the second half, out_proj.

(`mixer_types` rather than transformers' `layer_types`: transformers validates and renames the latter, "conv"
becoming "linear_attention".) The default layout is that of hazyresearch/based's released models: in every 5 layers, layer 1 is linear
attention, layer 2 sliding-window attention, the rest BaseConv (alt_mixer_layers 1, 6, 11, ...;
alt_mixer_2_layers 2, 7, 12, ...).
"""
from __future__ import annotations

from transformers import PreTrainedConfig

MIXER_TYPES = ("conv", "linear_attention", "sliding_attention")


def default_mixer_types(num_hidden_layers: int) -> list[str]:
    kinds = {1: "linear_attention", 2: "sliding_attention"}
    return [kinds.get(i % 5, "conv") for i in range(num_hidden_layers)]


class BasedConfig(PreTrainedConfig):
    model_type = "based"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 16384
    hidden_size: int = 1024
    intermediate_size: int = 2048
    num_hidden_layers: int = 6
    mixer_types: list[str] | None = None
    # sliding-window attention
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    sliding_window: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # Taylor linear attention
    linear_attn_num_heads: int = 16
    linear_attn_feature_dim: int = 16
    linear_attn_use_norm: bool = True
    # BaseConv
    conv_kernel: int = 3
    conv_expand: int = 2
    conv_bias: bool = True
    # everything else
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.mixer_types is None:
            self.mixer_types = default_mixer_types(self.num_hidden_layers)
        self.mixer_types = list(self.mixer_types)
        if len(self.mixer_types) != self.num_hidden_layers:
            raise ValueError(f"mixer_types must have num_hidden_layers ({self.num_hidden_layers}) entries, "
                             f"got {len(self.mixer_types)}")
        unknown = sorted(set(self.mixer_types) - set(MIXER_TYPES))
        if unknown:
            raise ValueError(f"mixer_types entries must be one of {MIXER_TYPES}, got {unknown}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_size % self.linear_attn_num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of linear_attn_num_heads "
                             f"({self.linear_attn_num_heads})")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        super().__post_init__(**kwargs)

    @property
    def linear_attn_head_dim(self) -> int:
        """The value head width of the linear-attention layers (the state is (1 + f + f^2) x (this + 1))."""
        return self.hidden_size // self.linear_attn_num_heads

    @property
    def conv_dim(self) -> int:
        return self.conv_expand * self.hidden_size


__all__ = ["BasedConfig", "MIXER_TYPES", "default_mixer_types"]
