"""Build a random-weight, Llama-shaped test model with a locally trained tokenizer: no hub access at all.

    python examples/build_tiny_model.py OUT_DIR [--preset tiny-hd128] [--seed 0]

OUT_DIR gets what `AutoModelForCausalLM.from_pretrained` and `vllm serve` read: config.json,
generation_config.json, model.safetensors (bfloat16), and a byte-level BPE tokenizer (tokenizer.json,
tokenizer_config.json with a ChatML chat template). The tokenizer is trained with the `tokenizers` library on
text generated here from a fixed word list, so the same seed gives the same files on any machine.

Presets keep realistic head counts and widths (a toy 2-layer, hidden-256 model with a word-level tokenizer was
seen to hang vLLM's start-up; see ../shared/offline-vllm/README.md):

    tiny-hd64        hidden 1024, 16 q heads / 4 kv heads of 64, 4 layers
    tiny-hd128       hidden 2048, 16 q heads / 8 kv heads of 128, 4 layers
    tiny-hd128-mqa   hidden 1024,  8 q heads / 1 kv head  of 128, 4 layers (fewer KV heads than TP ranks)
    llama3-8b-4l     Llama-3-8B's shapes (hidden 4096, 32 / 8 heads of 128, MLP 14336), 4 layers

Random models have nearly tied logits, so greedy decoding of two correct attention implementations drifts
apart after a few tokens. `--lm-head-scale` (default 4) widens the logit spread to make that rarer; it changes
nothing else.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PRESETS = {
    "tiny-hd64": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=64),
    "tiny-hd128": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "tiny-hd128-mqa": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=1, head_dim=128),
    "llama3-8b-4l": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128),
}

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the of and to in is was for that on with as by at from it this be are or an which have not has had one "
    "were their all been more when there can who so if will would about what up out them some time could into "
    "other than then now only its over also after first two new may these any most people way well many should "
    "kernel tile warp thread block memory cache page attention query key value head layer model token batch "
    "sequence length decode prefill server request response latency throughput bandwidth tensor matrix vector "
    "shared global register pipeline stage barrier semaphore load store compute finish schedule plan split merge "
    "river mountain city market garden window winter summer morning evening music story letter office school "
    "doctor teacher engineer student family friend country history science language number question answer "
    "red green blue small large quick slow bright dark warm cold early late simple careful honest curious "
    "run walk read write build test measure count compare explain describe remember choose begin continue"
).split()
_NAMES = "Ada Alan Grace Linus Margaret Dennis Barbara Ken Frances Edsger Donald Radia Leslie Tony".split()


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.08:
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        return f"{rng.choice(_NAMES)} computed {a} + {b} = {a + b}."
    if kind < 0.14:
        name = rng.choice(_WORDS)
        return f"def {name}_{rng.randint(0, 99)}(x, y):\n    return x * {rng.randint(1, 9)} + y  # {rng.choice(_WORDS)}"
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), rng.choice(_NAMES))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ";", ","])


def corpus(seed: int, num_lines: int = 40_000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        line = " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.1:
            line = f"{IM_START}user\n{line}{IM_END}\n{IM_START}assistant\n{_sentence(rng)}{IM_END}"
        lines.append(line)
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int, seed: int, model_max_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START, IM_END], model_max_length=model_max_length)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build(out_dir: str | Path, preset: str = "tiny-hd128", seed: int = 0, vocab_size: int = 16384,
          lm_head_scale: float = 4.0, max_position_embeddings: int = 8192) -> Path:
    """Write the model and tokenizer to out_dir (skipped if out_dir already holds this preset and seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def write(out: Path) -> None:
        tokenizer = build_tokenizer(out, vocab_size, seed, max_position_embeddings)
        config = LlamaConfig(
            max_position_embeddings=max_position_embeddings,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            **token_ids(tokenizer),
            **PRESETS[preset],
        )
        save_random_model(LlamaForCausalLM, config, out, seed, lm_head_scale)

    stamp = {"seed": seed, "vocab_size": vocab_size, "lm_head_scale": lm_head_scale,
             "max_position_embeddings": max_position_embeddings}
    return build_once(out_dir, preset, PRESETS, stamp, write)


def build_once(out_dir: str | Path, preset: str, presets: dict, stamp: dict, write) -> Path:
    """write(out_dir) unless out_dir already holds the model of this preset and stamp (the build's arguments),
    which is then recorded there; an unknown preset is refused."""
    out_dir = Path(out_dir)
    stamp = {"preset": preset, **stamp}
    stamp_file = out_dir / "tk_tiny_model.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return out_dir
    if preset not in presets:
        raise ValueError(f"preset must be one of {', '.join(presets)}, got {preset!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    write(out_dir)
    stamp_file.write_text(json.dumps(stamp))
    return out_dir


def token_ids(tokenizer) -> dict:
    """The config entries every test model takes from its tokenizer (embedding rows rounded up to 64, as real
    models do; end of text and end of a chat turn both stop generation)."""
    return dict(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )


def save_random_model(model_cls, config, out_dir: Path, seed: int, lm_head_scale: float) -> None:
    """Random weights from `seed` (the LM head scaled so logits are less tied), bf16, greedy generation config,
    saved as safetensors."""
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(lm_head_scale)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out_dir, safe_serialization=True)


def cli(build_fn, presets: dict, default_preset: str, default_lm_head_scale: float, doc: str) -> None:
    """The command line of a model builder: OUT_DIR [--preset] [--seed] [--vocab-size] [--lm-head-scale]."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", default=default_preset, choices=sorted(presets))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--lm-head-scale", type=float, default=default_lm_head_scale)
    args = parser.parse_args()
    path = build_fn(args.out_dir, args.preset, args.seed, args.vocab_size, args.lm_head_scale)
    print(f"wrote {args.preset} (seed {args.seed}) to {path}")


def main() -> None:
    cli(build, PRESETS, "tiny-hd128", 4.0, __doc__)


if __name__ == "__main__":
    main()
