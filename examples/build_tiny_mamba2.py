"""Build a random-weight Mamba-2 test model (transformers' Mamba2ForCausalLM) with a locally trained tokenizer.

    python examples/build_tiny_mamba2.py OUT_DIR [--preset mamba2-n128-g8] [--seed 0]

OUT_DIR gets what `AutoModelForCausalLM.from_pretrained` and `vllm serve` read: config.json (architecture
Mamba2ForCausalLM, model_type mamba2), generation_config.json, model.safetensors (bfloat16) and the same
byte-level BPE tokenizer as examples/build_tiny_model.py (trained here, no hub access).

vLLM (0.26 and 0.33) serves the architecture name Mamba2ForCausalLM with vllm/model_executor/models/mamba2.py,
which reads hidden_size, num_hidden_layers, vocab_size, state_size, conv_kernel, expand (intermediate size =
expand * hidden_size, which must equal num_heads * head_dim), n_groups, num_heads, head_dim, use_bias,
use_conv_bias, hidden_act, layer_norm_epsilon, tie_word_embeddings, and chunk_size (as the SSD chunk size;
`mamba_chunk_size` would take precedence). The config has no max_position_embeddings, so vLLM caps
max_model_len at 2048 unless it is given.

Presets use headdim 64, the two state sizes and both group layouts of the released Mamba-2 / Codestral-Mamba
models, at a width (hidden 1024, 32 heads) that keeps vLLM's start-up ordinary:

    mamba2-n128-g8   hidden 1024, 32 heads of 64, d_state 128, 8 groups, 4 layers
    mamba2-n64-g1    hidden 1024, 32 heads of 64, d_state  64, 1 group,  4 layers

`--lm-head-scale` (default 1) scales the output head. Mamba2's initializer (std 0.1) already gives a logit spread
(std ~3) like build_tiny_model.py's Llama presets at their default scale 4.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_tiny_model import build_once, build_tokenizer, cli, save_random_model, token_ids  # noqa: E402

COMMON = dict(hidden_size=1024, num_heads=32, head_dim=64, expand=2, num_hidden_layers=4, conv_kernel=4,
              chunk_size=256)
PRESETS = {
    "mamba2-n128-g8": dict(COMMON, state_size=128, n_groups=8),
    "mamba2-n64-g1": dict(COMMON, state_size=64, n_groups=1),
}


def build(out_dir: str | Path, preset: str = "mamba2-n128-g8", seed: int = 0, vocab_size: int = 16384,
          lm_head_scale: float = 1.0) -> Path:
    """Write the model and tokenizer to out_dir (skipped if out_dir already holds this preset and seed)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    shape = PRESETS.get(preset)
    if shape and shape["expand"] * shape["hidden_size"] != shape["num_heads"] * shape["head_dim"]:
        raise ValueError(f"preset {preset}: expand * hidden_size must equal num_heads * head_dim")

    def write(out: Path) -> None:
        tokenizer = build_tokenizer(out, vocab_size, seed, model_max_length=2048)
        config = Mamba2Config(
            layer_norm_epsilon=1e-5,
            use_bias=False,
            use_conv_bias=True,
            hidden_act="silu",
            tie_word_embeddings=False,
            **token_ids(tokenizer),
            **shape,
        )
        config.architectures = ["Mamba2ForCausalLM"]
        save_random_model(Mamba2ForCausalLM, config, out, seed, lm_head_scale)

    stamp = {"seed": seed, "vocab_size": vocab_size, "lm_head_scale": lm_head_scale, "arch": "Mamba2ForCausalLM"}
    return build_once(out_dir, preset, PRESETS, stamp, write)


def main() -> None:
    cli(build, PRESETS, "mamba2-n128-g8", 1.0, __doc__)


if __name__ == "__main__":
    main()
