"""examples/build_tiny_model.py: the test model and its locally trained tokenizer load and run, with no hub.

Builds the smallest preset once, then loads it the way transformers users (and vLLM) do, and runs it with
attn_implementation="tk" on the float32 references against "eager".
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("tokenizers", reason="tokenizers is not installed")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def builder():
    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "examples" / "build_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(builder, tmp_path_factory) -> Path:
    return builder.build(tmp_path_factory.mktemp("tiny") / "hd64", preset="tiny-hd64", seed=0, vocab_size=4096)


def test_files_and_config(builder, model_dir):
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    preset = builder.PRESETS["tiny-hd64"]
    assert config["model_type"] == "llama" and config["dtype"] == "bfloat16"
    assert config["hidden_size"] == preset["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0  # GQA
    assert config["head_dim"] == 64 and config["vocab_size"] % 64 == 0
    # Building again with the same arguments is a no-op.
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    builder.build(model_dir, preset="tiny-hd64", seed=0, vocab_size=4096)
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_presets_have_realistic_shapes(builder):
    for name, p in builder.PRESETS.items():
        assert p["num_attention_heads"] * p["head_dim"] == p["hidden_size"], name
        assert p["head_dim"] in (64, 128) and p["hidden_size"] >= 1024 and p["num_attention_heads"] >= 8, name


def test_tokenizer_round_trips_and_has_a_chat_template(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "The kernel reads 42 pages; Ada asks why?"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode()) // 2  # BPE merged something
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|begin_of_text|><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_model_runs_with_tk_attention(model_dir, monkeypatch):
    import tk_backend.hf as tk_hf
    from tk_backend import reference

    calls = []

    def dense(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **_):
        calls.append("dense")
        return reference.attention_dense(q, k, v, causal, softmax_scale, window_size, softcap)[0].to(q.dtype)

    monkeypatch.setattr(tk_hf, "flash_attn_func", dense)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok(["A small model reads a tile of memory."], return_tensors="pt")["input_ids"]
    tk = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="tk", dtype=torch.float32)
    eager = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                              dtype=torch.float32)
    with torch.no_grad():
        got, want = tk(ids).logits, eager(ids).logits
    assert calls == ["dense"] * tk.config.num_hidden_layers
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-3), float((got - want).abs().max())
