"""Write the config.json of a real model's shape, and nothing else: vLLM serves it with `load_format="dummy"`
(random weights, nothing downloaded) and prompts given as token ids (`skip_tokenizer_init=True`).

    python examples/build_model_configs.py OUT_DIR --preset phi3-mini [--layers 4]

Presets: the shapes the TK backend was first refused for (phi3-mini, bge-base, gpt-oss-20b; see
tests/gpu/test_vllm_models.py) and the serve bench's full-size models (scripts/benches/serve.py):

    phi3-mini     Phi-3-mini-4k (Phi3ForCausalLM): hidden 3072, 32 heads of 96 (no GQA), MLP 8192, 32 layers,
                  a 2047-token sliding window, vocabulary 32064
    bge-base      an encoder-only embedding model shaped like bge-base-en-v1.5 (BertModel): hidden 768, 12 heads
                  of 64, MLP 3072, 12 layers, 512 positions, vocabulary 30522
    gpt-oss-20b   gpt-oss-20b's attention and MoE (GptOssForCausalLM): hidden 2880, 64 q / 8 kv heads of 64,
                  attention sinks, 128-token sliding windows on every other layer (the others full), 32 experts
                  (4 a token), 24 layers, vocabulary 201088; unquantized (bfloat16) where the release is MXFP4
    llama3.1-8b   Llama-3.1-8B (LlamaForCausalLM): hidden 4096, 32 q / 8 kv heads of 128, MLP 14336, 32 layers,
                  llama3 rope (theta 500000, factor 8), 131072 positions, vocabulary 128256
    llama3.2-1b   Llama-3.2-1B (LlamaForCausalLM): hidden 2048, 32 q / 8 kv heads of 64, MLP 8192, 16 layers,
                  llama3 rope (theta 500000, factor 32), 131072 positions, vocabulary 128256, tied embeddings
    qwen2.5-7b    Qwen2.5-7B-Instruct (Qwen2ForCausalLM): hidden 3584, 28 q / 4 kv heads of 128 (q/k/v biases),
                  MLP 18944, 28 layers, rope theta 1e6, 32768 positions, no sliding window, vocabulary 152064
    gemma2-9b     Gemma-2-9B (Gemma2ForCausalLM): hidden 3584, 16 q / 8 kv heads of 256, MLP 14336, 42 layers,
                  logit soft caps 50 (attention) / 30 (final), a 4096-token sliding window on the even layers
                  (the odd ones full), 8192 positions, vocabulary 256000, tied embeddings
    mamba2-2.7b   Mamba2-2.7B (Mamba2ForCausalLM): 64 Mamba-2 layers, hidden 2560, 80 heads of 64 (expand 2),
                  state 128, 1 group, conv 4, chunk 256, vocabulary 50288, tied embeddings; no attention, no
                  positions (vLLM takes any max_model_len)
    nemotron-h-8b Nemotron-H-8B-Base-8K (NemotronHForCausalLM): 52 layers by hybrid_override_pattern (24 Mamba-2
                  "M", 4 attention "*", 24 ReLU^2 MLP "-"), hidden 4096; Mamba-2: 128 heads of 64, state 128,
                  8 groups, conv 4, chunk 128; attention: 32 q / 8 kv heads of 128, no rope; MLP 21504; 8192
                  positions, vocabulary 131072
    falcon-h1-1.5b Falcon-H1-1.5B (FalconH1ForCausalLM): 24 layers, each attention and Mamba-2 side by side, then
                  an MLP; hidden 2048; attention: 8 q / 2 kv heads of 128; Mamba-2: 48 heads of 64 (d_ssm 3072),
                  state 256, 1 group, conv 4; MLP 4608; 131072 positions, vocabulary 65537; the release's
                  mu-P multipliers left at 1 (they scale activations, not shapes)

--layers keeps the first N layers (a test's engines start in seconds instead of minutes); the per-layer pattern
(gpt-oss's and Gemma-2's alternating windows, Nemotron-H's hybrid_override_pattern) is kept. The configs are built with transformers' own config classes,
so they are what `AutoConfig.from_pretrained` and vLLM read.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def phi3_mini(layers: int) -> dict:
    return dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
        max_position_embeddings=4096, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0), sliding_window=2047, vocab_size=32064,
        bos_token_id=1, eos_token_id=32000, pad_token_id=32000, tie_word_embeddings=False,
    )


def bge_base(layers: int) -> dict:
    return dict(
        architectures=["BertModel"], model_type="bert", hidden_size=768, intermediate_size=3072,
        num_hidden_layers=layers, num_attention_heads=12, hidden_act="gelu", max_position_embeddings=512,
        type_vocab_size=2, layer_norm_eps=1e-12, vocab_size=30522, pad_token_id=0,
    )


def gpt_oss_20b(layers: int) -> dict:
    return dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8, head_dim=64, attention_bias=True,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=4096),
        vocab_size=201088, eos_token_id=200002, pad_token_id=199999, tie_word_embeddings=False,
    )


def _llama3(layers: int, hidden: int, heads: int, head_dim: int, mlp: int, rope_factor: float, tied: bool) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, intermediate_size=mlp,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=head_dim,
        hidden_act="silu", attention_bias=False, mlp_bias=False, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=rope_factor, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192),
        vocab_size=128256, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=tied,
    )


def llama3_1_8b(layers: int) -> dict:
    return _llama3(layers, hidden=4096, heads=32, head_dim=128, mlp=14336, rope_factor=8.0, tied=False)


def llama3_2_1b(layers: int) -> dict:
    return _llama3(layers, hidden=2048, heads=32, head_dim=64, mlp=8192, rope_factor=32.0, tied=True)


def qwen2_5_7b(layers: int) -> dict:
    return dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=layers, num_attention_heads=28, num_key_value_heads=4, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default",
                                                                               rope_theta=1000000.0),
        use_sliding_window=False, max_window_layers=28, vocab_size=152064, bos_token_id=151643,
        eos_token_id=151645, tie_word_embeddings=False,
    )


def gemma2_9b(layers: int) -> dict:
    return dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=3584, intermediate_size=14336,
        num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, sliding_window=4096,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        attention_bias=False, vocab_size=256000, bos_token_id=2, eos_token_id=1, pad_token_id=0,
        tie_word_embeddings=True,
    )


def mamba2_2_7b(layers: int) -> dict:
    # state-spaces/mamba2-2.7b's d_model, n_layer, headdim, d_state, ngroups and padded vocabulary, in transformers'
    # Mamba2Config names (the fields vLLM's mamba2.py reads; examples/build_tiny_mamba2.py lists them).
    return dict(
        architectures=["Mamba2ForCausalLM"], model_type="mamba2", hidden_size=2560, num_hidden_layers=layers,
        num_heads=80, head_dim=64, expand=2, state_size=128, n_groups=1, conv_kernel=4, chunk_size=256,
        use_bias=False, use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5, rms_norm=True,
        residual_in_fp32=True, vocab_size=50288, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        tie_word_embeddings=True,
    )


# Nemotron-H-8B-Base-8K's layer pattern: M a Mamba-2 layer, * attention, - an MLP (52 layers).
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def nemotron_h_8b(layers: int) -> dict:
    # transformers 5 reads the pattern into layers_block_type (its num_hidden_layers is the list's length);
    # build() also writes the pattern and the layer count back, as the release's config.json has them.
    return dict(
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=4096,
        hybrid_override_pattern=NEMOTRON_H_8B_PATTERN[:layers], intermediate_size=21504, mlp_hidden_act="relu2",
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, attention_bias=False, mlp_bias=False,
        mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2,
        chunk_size=128, use_conv_bias=True, use_bias=False, mamba_hidden_act="silu", layer_norm_epsilon=1e-5,
        residual_in_fp32=False, max_position_embeddings=8192, vocab_size=131072, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False,
    )


def falcon_h1_1_5b(layers: int) -> dict:
    return dict(
        architectures=["FalconH1ForCausalLM"], model_type="falcon_h1", hidden_size=2048, intermediate_size=4608,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=128, hidden_act="silu",
        mamba_d_ssm=3072, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=256, mamba_n_groups=1, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=128, mamba_conv_bias=True, mamba_proj_bias=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e11), max_position_embeddings=131072,
        rms_norm_eps=1e-5, vocab_size=65537, bos_token_id=1, eos_token_id=11, pad_token_id=0,
        tie_word_embeddings=False,
    )


# preset -> (config of `layers` layers, the release's layer count)
PRESETS = {"phi3-mini": (phi3_mini, 32), "bge-base": (bge_base, 12), "gpt-oss-20b": (gpt_oss_20b, 24),
           "llama3.1-8b": (llama3_1_8b, 32), "llama3.2-1b": (llama3_2_1b, 16), "qwen2.5-7b": (qwen2_5_7b, 28),
           "gemma2-9b": (gemma2_9b, 42), "mamba2-2.7b": (mamba2_2_7b, 64), "nemotron-h-8b": (nemotron_h_8b, 52),
           "falcon-h1-1.5b": (falcon_h1_1_5b, 24)}


def config(preset: str, layers: int | None = None, **overrides):
    """The preset's transformers config (layers: the first N layers; default: all of the release's), with
    `overrides` replacing fields (a shape the preset is not, e.g. to check what is refused)."""
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    make, full = PRESETS[preset]
    layers = full if layers is None else layers
    if not 1 <= layers <= full:
        raise ValueError(f"layers must be between 1 and {full} for {preset}, got {layers}")
    fields = {**make(layers), **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), dtype="bfloat16", **fields)


def build(out_dir: str | Path, preset: str, layers: int | None = None, tokenizer: bool = False,
          weights: bool = False, seed: int = 0, lm_head_scale: float = 1.0, **overrides) -> Path:
    """Write out_dir/config.json for the preset (config's arguments; rewritten only when it changes); returns
    out_dir. tokenizer: also a locally trained byte-level BPE tokenizer (build_tiny_model's, 4096 tokens), for
    what vLLM will not run without one (its pooling runner). weights: also random weights from `seed`
    (transformers' initializer, bfloat16, model.safetensors under the release's tensor names; the LM head times
    lm_head_scale), for tests that compare paths on one model: vLLM's dummy weights are +-1e-3, whose logits are
    nearly flat, and differ between dtypes."""
    out_dir = Path(out_dir)
    cfg = config(preset, layers, **overrides)
    fields = json.loads(cfg.to_json_string(use_diff=False))
    if cfg.model_type == "nemotron_h":  # the release's names too, for readers that predate layers_block_type
        fields.update(hybrid_override_pattern=cfg.hybrid_override_pattern, num_hidden_layers=cfg.num_hidden_layers)
    text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
    path = out_dir / "config.json"
    if not path.exists() or json.loads(path.read_text()) != json.loads(text):
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if tokenizer and not (out_dir / "tokenizer.json").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from build_tiny_model import build_tokenizer

        build_tokenizer(out_dir, 4096, 0, cfg.max_position_embeddings)
    stamp = out_dir / "weights.json"  # what the weights were made from: rebuilt when the config or seed changes
    made_from = {"config": json.loads(text), "seed": seed, "lm_head_scale": lm_head_scale}
    if weights and not (stamp.exists() and json.loads(stamp.read_text()) == made_from):
        save_random_weights(cfg, out_dir, seed, lm_head_scale)
        stamp.write_text(json.dumps(made_from, sort_keys=True) + "\n")
    return out_dir


def save_random_weights(cfg, out_dir: Path, seed: int, lm_head_scale: float = 1.0) -> None:
    """out_dir/model.safetensors (and a greedy generation_config.json) of cfg's transformers model, initialized
    from `seed` (the LM head scaled, so that logits are less tied); the config.json that save_pretrained writes is
    not kept (out_dir's own is the release's form)."""
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(lm_head_scale)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                                               pad_token_id=cfg.pad_token_id, do_sample=False)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for name in ("model.safetensors", "generation_config.json"):
            shutil.move(str(Path(tmp) / name), str(out_dir / name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    parser.add_argument("--tokenizer", action="store_true", help="also write a locally trained tokenizer")
    args = parser.parse_args()
    path = build(args.out_dir, args.preset, args.layers, args.tokenizer) / "config.json"
    print(f"wrote {args.preset} ({json.loads(path.read_text())['num_hidden_layers']} layers) to {path}")


if __name__ == "__main__":
    main()
