"""Write the config.json of a real model's shape, and nothing else: vLLM serves it with `load_format="dummy"`
(random weights, nothing downloaded) and prompts given as token ids (`skip_tokenizer_init=True`).

    python examples/build_model_configs.py OUT_DIR --preset phi3-mini [--layers 4]

Presets (the shapes the TK backend was first refused for; see tests/gpu/test_vllm_models.py):

    phi3-mini     Phi-3-mini-4k (Phi3ForCausalLM): hidden 3072, 32 heads of 96 (no GQA), MLP 8192, 32 layers,
                  a 2047-token sliding window, vocabulary 32064
    bge-base      an encoder-only embedding model shaped like bge-base-en-v1.5 (BertModel): hidden 768, 12 heads
                  of 64, MLP 3072, 12 layers, 512 positions, vocabulary 30522
    gpt-oss-20b   gpt-oss-20b's attention and MoE (GptOssForCausalLM): hidden 2880, 64 q / 8 kv heads of 64,
                  attention sinks, 128-token sliding windows on every other layer (the others full), 32 experts
                  (4 a token), 24 layers, vocabulary 201088; unquantized (bfloat16) where the release is MXFP4

--layers keeps the first N layers (a test's engines start in seconds instead of minutes); the per-layer pattern
(gpt-oss's alternating windows) is kept. The configs are built with transformers' own config classes, so they
are what `AutoConfig.from_pretrained` and vLLM read.
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


# preset -> (config of `layers` layers, the release's layer count)
PRESETS = {"phi3-mini": (phi3_mini, 32), "bge-base": (bge_base, 12), "gpt-oss-20b": (gpt_oss_20b, 24)}


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
          **overrides) -> Path:
    """Write out_dir/config.json for the preset (config's arguments; rewritten only when it changes); returns
    out_dir. tokenizer: also a locally trained byte-level BPE tokenizer (build_tiny_model's, 4096 tokens), for
    what vLLM will not run without one (its pooling runner)."""
    out_dir = Path(out_dir)
    cfg = config(preset, layers, **overrides)
    text = cfg.to_json_string(use_diff=False)
    path = out_dir / "config.json"
    if not path.exists() or json.loads(path.read_text()) != json.loads(text):
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if tokenizer and not (out_dir / "tokenizer.json").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from build_tiny_model import build_tokenizer

        build_tokenizer(out_dir, 4096, 0, cfg.max_position_embeddings)
    return out_dir


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
