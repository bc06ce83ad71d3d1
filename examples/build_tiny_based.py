"""Build a random-weight Based model (tk_backend.models) with a locally trained tokenizer: no hub access at all.

    python examples/build_tiny_based.py OUT_DIR [--preset tiny-based] [--seed 0]

OUT_DIR gets config.json (model_type "based", architectures ["BasedForCausalLM"]), generation_config.json,
model.safetensors (bfloat16) and the byte-level BPE tokenizer of examples/build_tiny_model.py. transformers
loads it after `tk_backend.models.register()`; vLLM serves it through the tk_backend plugin.

Presets (hidden 1024; the linear-attention layers have 16 heads of feature dim 16 and value dim 64, the
sliding-window layers 16 heads of 64 over a 64-token window, BaseConv a width-3 convolution over 2048 channels):

    tiny-based      6 layers: conv, linear, window, conv, linear, window
    tiny-based-5    5 layers in hazyresearch/based's order: conv, linear, window, conv, conv

`--lm-head-scale` (default 4) widens the logit spread of the random model, as in build_tiny_model.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from build_tiny_model import build_once, build_tokenizer, cli, save_random_model, token_ids  # noqa: E402

_BASE = dict(hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=16,
             linear_attn_num_heads=16, linear_attn_feature_dim=16, sliding_window=64, conv_kernel=3, conv_expand=2)
PRESETS = {
    "tiny-based": dict(_BASE, num_hidden_layers=6, mixer_types=["conv", "linear_attention", "sliding_attention"] * 2),
    "tiny-based-5": dict(_BASE, num_hidden_layers=5,
                         mixer_types=["conv", "linear_attention", "sliding_attention", "conv", "conv"]),
}


def build(out_dir: str | Path, preset: str = "tiny-based", seed: int = 0, vocab_size: int = 16384,
          lm_head_scale: float = 4.0, max_position_embeddings: int = 4096) -> Path:
    """Write the model and tokenizer to out_dir (skipped if out_dir already holds this preset and seed)."""
    from tk_backend.models import BasedConfig
    from tk_backend.models.modeling_based import BasedForCausalLM

    def write(out: Path) -> None:
        tokenizer = build_tokenizer(out, vocab_size, seed, max_position_embeddings)
        config = BasedConfig(
            max_position_embeddings=max_position_embeddings,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            architectures=["BasedForCausalLM"],
            **token_ids(tokenizer),
            **PRESETS[preset],
        )
        save_random_model(BasedForCausalLM, config, out, seed, lm_head_scale)

    stamp = {"seed": seed, "vocab_size": vocab_size, "lm_head_scale": lm_head_scale,
             "max_position_embeddings": max_position_embeddings}
    return build_once(out_dir, preset, PRESETS, stamp, write)


def main() -> None:
    cli(build, PRESETS, "tiny-based", 4.0, __doc__)


if __name__ == "__main__":
    main()
