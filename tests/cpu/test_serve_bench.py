"""scripts/benches/serve.py without a GPU: the case table and its names, the KV-cache arithmetic per model, the
full-size configs (built with transformers, read by vLLM at the engines' max_model_len), the selection variables,
the engines' LLM(...) keyword arguments and server flags, the rows made from runs, the failure record, and the
online client and worker against a stand-in OpenAI server (the real engines run on the GPU host only).
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "examples"))
import build_model_configs  # noqa: E402
from benches import serve  # noqa: E402

KiB, GiB = 1 << 10, 1 << 30
FULL = ["llama3.1-8b", "qwen2.5-7b", "gemma2-9b", "llama3.2-1b", "phi3-mini"]
MAMBA = ["mamba2-2.7b", "nemotron-h-8b", "falcon-h1-1.5b"]


# ------------------------------------------------------------------------------------------- cases and names


def test_the_4_layer_cases_keep_their_names_and_shapes():
    assert serve.CASES == {"offline_512x1024in_256out": (512, 1024, 256), "offline_64x128in_1024out": (64, 128, 1024)}
    assert [c.kind for c in serve.CASE_TABLE if c.model == serve.PRESET] == ["prefill", "decode"]
    # the prompts are the ones the family always drew (fixed lengths take nothing from the generator)
    import random

    rng = random.Random(7)
    assert serve._prompts(3, 5, 1000, seed=7) == [[rng.randrange(16, 1000) for _ in range(5)] for _ in range(3)]


def test_full_size_cases_are_named_by_model_kind_and_shape():
    names = {c.name for c in serve.CASE_TABLE}
    for model in FULL:
        assert {f"{model}_prefill_128x2048in_32out", f"{model}_decode_128x512in_512out",
                f"{model}_long_8x24576in_256out", f"{model}_online_256x128-2048in_256out_8rps"} <= names
    assert {"llama3.1-8b_prefill_128x2048in_32out_fp8", "llama3.1-8b_decode_128x512in_512out_fp8",
            "bge-base_embed_1024x64-512in"} <= names
    assert not any(n.endswith("_fp8") and not n.startswith("llama3.1-8b_") for n in names)
    assert len(names) == len(serve.CASE_TABLE) == 2 + 4 * 5 + 2 + 1 + 3 * len(MAMBA)
    by_name = serve.ALL_CASES
    long = by_name["llama3.1-8b_long_8x24576in_256out"]
    assert (long.prompts, long.prompt_len, long.new_tokens) == (8, 24576, 256)
    assert long.longest_prompt + long.new_tokens == 24832 <= serve.MODELS["llama3.1-8b"].max_model_len
    fp8 = by_name["llama3.1-8b_decode_128x512in_512out_fp8"]
    assert (fp8.kind, fp8.kv_cache_dtype, fp8.prompts, fp8.prompt_len, fp8.new_tokens) == (
        "decode_fp8", "fp8", 128, 512, 512)
    online = by_name["llama3.1-8b_online_256x128-2048in_256out_8rps"]
    assert (online.prompts, online.prompt_len, online.new_tokens, online.rate) == (256, (128, 2048), 256, 8.0)
    embed = by_name["bge-base_embed_1024x64-512in"]
    assert (embed.prompts, embed.prompt_len, embed.new_tokens) == (1024, (64, 512), 0)
    # every case's prompts fit its model's context
    for c in serve.CASE_TABLE:
        assert c.longest_prompt + c.new_tokens <= serve.MODELS[c.model].max_model_len, c.name


def test_ranged_prompts_draw_their_lengths_first_and_the_expected_tokens_follow():
    a = serve._prompts(50, (64, 512), 4096, seed=7)
    b = serve._prompts(50, (64, 512), 128256, seed=7)
    assert [len(p) for p in a] == [len(p) for p in b]  # the vocabulary does not move the lengths
    assert 64 <= min(map(len, a)) and max(map(len, a)) <= 512 and len(set(map(len, a))) > 10
    assert all(16 <= t < 4096 for p in a for t in p)
    embed = serve.ALL_CASES["bge-base_embed_1024x64-512in"]
    assert embed.expected_tokens == sum(map(len, serve._prompts(1024, (64, 512), 30522, seed=serve.PROMPT_SEED)))
    assert serve.ALL_CASES["llama3.1-8b_decode_128x512in_512out"].expected_tokens == 128 * 512


# ------------------------------------------------------------------------------------------- KV arithmetic


@pytest.mark.parametrize("model, layers, kv_heads, head_dim", [
    ("llama3-8b-4l", 4, 8, 128), ("llama3.1-8b", 32, 8, 128), ("qwen2.5-7b", 28, 4, 128), ("gemma2-9b", 42, 8, 256),
    ("llama3.2-1b", 16, 8, 64), ("phi3-mini", 32, 32, 96), ("bge-base", 12, 12, 64)])
def test_kv_bytes_a_token(model, layers, kv_heads, head_dim):
    assert serve.model_shape(model) == (layers, kv_heads, head_dim)
    assert serve.kv_bytes_per_token(model) == layers * 2 * kv_heads * head_dim * 2
    assert serve.kv_bytes_per_token(model, "fp8") == layers * 2 * kv_heads * head_dim


def test_kv_bytes_of_the_named_models():
    assert serve.kv_bytes_per_token("llama3.1-8b") == 128 * KiB  # 32 x 2 x 8 x 128 x 2 bytes
    assert serve.kv_bytes_per_token("llama3.1-8b", "fp8") == 64 * KiB
    assert serve.kv_bytes_per_token("llama3-8b-4l") == 16 * KiB
    assert [serve.kv_bytes_per_token(m) // KiB for m in ("qwen2.5-7b", "gemma2-9b", "llama3.2-1b", "phi3-mini")] == [
        56, 336, 32, 384]


def test_every_engine_of_a_group_gets_the_kv_cache_the_docstring_states():
    G = serve.Group
    gib = {g: serve.kv_cache_bytes(g) / GiB for g in (
        G("llama3-8b-4l"), G("llama3.1-8b"), G("llama3.1-8b", "fp8"), G("llama3.1-8b", online=True),
        G("qwen2.5-7b"), G("qwen2.5-7b", online=True), G("gemma2-9b"), G("llama3.2-1b"),
        G("llama3.2-1b", online=True), G("phi3-mini"), G("bge-base"))}
    assert list(gib.values()) == [8, 36, 18, 20, 16, 9, 40, 9, 5, 40, 1]
    # Llama-3.1-8B: the prefill case holds 128 x 2080 tokens at 128 KiB = 32.5 GiB; x 1.1 -> 36 GiB
    prefill = serve.ALL_CASES["llama3.1-8b_prefill_128x2048in_32out"]
    assert prefill.peak_tokens == 128 * 2080
    assert prefill.peak_tokens * 128 * KiB == 32.5 * GiB
    # uncapped caches hold every case of their group at its peak
    for group, _ in serve.plan(list(serve.CASE_TABLE)):
        size = serve.kv_cache_bytes(group)
        if size < serve.KV_CACHE_CAP_BYTES and group.model != serve.PRESET:
            for c in serve.CASE_TABLE:
                if (c.model, c.kv_cache_dtype, c.online) == (group.model, group.kv_cache_dtype, group.online):
                    assert c.peak_tokens * serve.kv_bytes_per_token(c.model, c.kv_cache_dtype) <= size, c.name
    # the 4-layer model's prefill case: 256 sequences (max_num_seqs) of 1280 tokens at 16 KiB: 5 GiB of its 8
    assert serve.ALL_CASES["offline_512x1024in_256out"].peak_tokens * 16 * KiB == 5 * GiB


def test_the_docstring_table_agrees_with_the_arithmetic():
    doc = serve.__doc__
    for model, kib, offline in (("llama3.1-8b", 128, 36), ("qwen2.5-7b", 56, 16), ("gemma2-9b", 336, 40),
                                ("llama3.2-1b", 32, 9), ("phi3-mini", 384, 40)):
        line = next(ln for ln in doc.splitlines() if ln.strip().startswith(model + " ") and "KiB" in ln)
        assert f"{kib} KiB" in line and f"{offline} GiB" in line, line
        assert serve.kv_cache_bytes(serve.Group(model)) == offline * GiB
        assert f"{serve.kv_cache_bytes(serve.Group(model, online=True)) // GiB} GiB" in line, line


# ------------------------------------------------------------------------------------------------ configs


# preset -> fields the config must have (transformers' names)
CONFIG_FIELDS = {
    "llama3.1-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=32,
                        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072,
                        tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_hidden_layers=28,
                       hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                       vocab_size=152064, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None),
    "gemma2-9b": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], num_hidden_layers=42,
                      hidden_size=3584, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                      intermediate_size=14336, vocab_size=256000, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, sliding_window=4096, query_pre_attn_scalar=256,
                      max_position_embeddings=8192, tie_word_embeddings=True),
    "llama3.2-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=16,
                        hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True),
}


@pytest.mark.parametrize("preset", sorted(CONFIG_FIELDS))
def test_the_full_size_configs_have_the_release_shapes(preset):
    from transformers import PretrainedConfig

    cfg = build_model_configs.config(preset)
    assert isinstance(cfg, PretrainedConfig) and type(cfg).__name__ != "PretrainedConfig"
    for field, value in CONFIG_FIELDS[preset].items():
        assert getattr(cfg, field) == value, field
    assert str(cfg.dtype).endswith("bfloat16")
    if preset.startswith("llama"):
        rope = cfg.rope_parameters
        assert (rope["rope_type"], rope["rope_theta"], rope["original_max_position_embeddings"]) == (
            "llama3", 500000.0, 8192)
        assert rope["factor"] == (8.0 if preset == "llama3.1-8b" else 32.0)
    if preset == "gemma2-9b":  # windows on the even layers, as vLLM's gemma2.py reads layer_types
        assert cfg.layer_types == ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(42)]
    assert build_model_configs.config(preset, 3).num_hidden_layers == 3


def test_the_bench_builds_each_model_so_vllm_takes_its_max_model_len(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.config import ModelConfig

    monkeypatch.setattr(serve.tempfile, "gettempdir", lambda: str(tmp_path))
    windows = {"gemma2-9b": 4096, "phi3-mini": 2047}
    for name in FULL:
        path = serve.build_model(name)
        assert path == tmp_path / f"tk_serve_{name}" and not (path / "tokenizer.json").exists()
        config = ModelConfig(model=str(path), runner="generate", max_model_len=32768, skip_tokenizer_init=True,
                             dtype="bfloat16")
        assert config.max_model_len == 32768 and config.get_sliding_window() == windows.get(name)
        assert config.get_head_size() == serve.model_shape(name)[2]
        assert config.get_total_num_kv_heads() == serve.model_shape(name)[1]
        assert serve.prompt_vocab(name, path) == config.get_vocab_size()
    # Gemma-2 and Phi-3 are built with more positions than their releases, which vLLM would refuse otherwise
    short = build_model_configs.build(tmp_path / "gemma-release", "gemma2-9b")
    with pytest.raises(Exception, match="max_model_len"):
        ModelConfig(model=str(short), runner="generate", max_model_len=32768, skip_tokenizer_init=True)
    bge = serve.build_model("bge-base")
    assert (bge / "tokenizer.json").exists() and serve.prompt_vocab("bge-base", bge) == 4096


# ------------------------------------------------------------------------------------------------ selection


def test_the_default_selection_is_the_run_the_family_always_made(monkeypatch):
    for var in ("TK_SERVE_MODELS", "TK_SERVE_CASES", "TK_SERVE_IMPLS", "TK_SERVE_REPEATS"):
        monkeypatch.delenv(var, raising=False)
    models = serve.selected_models()
    assert models == ["llama3-8b-4l"]
    assert [c.name for c in serve.selected_cases(models)] == list(serve.CASES)
    assert [c.name for c in serve.selected_cases(models, quick=True)] == ["offline_64x128in_1024out"]
    assert serve.selected_impls("llama3-8b-4l") == ["tk", "flash_attn", "triton_attn"]
    assert serve.rounds("llama3-8b-4l") == 5
    assert [(g, [c.name for c in cs]) for g, cs in serve.plan(serve.selected_cases(models))] == [
        (serve.Group("llama3-8b-4l"), list(serve.CASES))]


def _select_models(monkeypatch, names: str) -> list[str]:
    """TK_SERVE_MODELS=names and no other selection variable: the models selected."""
    monkeypatch.setenv("TK_SERVE_MODELS", names)
    for var in ("TK_SERVE_CASES", "TK_SERVE_IMPLS", "TK_SERVE_REPEATS"):
        monkeypatch.delenv(var, raising=False)
    return serve.selected_models()


def test_models_cases_and_impls_are_picked_by_name_or_kind(monkeypatch):
    models = _select_models(monkeypatch, "qwen2.5-7b,llama3.1-8b")
    assert models == ["qwen2.5-7b", "llama3.1-8b"]
    assert [c.name for c in serve.selected_cases(models)] == [
        "qwen2.5-7b_prefill_128x2048in_32out", "qwen2.5-7b_decode_128x512in_512out", "qwen2.5-7b_long_8x24576in_256out",
        "llama3.1-8b_prefill_128x2048in_32out", "llama3.1-8b_decode_128x512in_512out",
        "llama3.1-8b_long_8x24576in_256out"]  # fp8 and online only when named
    assert serve.selected_impls("llama3.1-8b") == ["tk", "flash_attn"] and serve.rounds("llama3.1-8b") == 3

    monkeypatch.setenv("TK_SERVE_CASES", "decode_fp8,online,qwen2.5-7b_long_8x24576in_256out,prefill_fp8")
    cases = serve.selected_cases(models)
    assert [c.name for c in cases] == [
        "qwen2.5-7b_long_8x24576in_256out", "qwen2.5-7b_online_256x128-2048in_256out_8rps",
        "llama3.1-8b_online_256x128-2048in_256out_8rps", "llama3.1-8b_prefill_128x2048in_32out_fp8",
        "llama3.1-8b_decode_128x512in_512out_fp8"]
    groups = serve.plan(cases)  # by model, then bf16, fp8, online engines
    assert [g.label for g, _ in groups] == ["qwen2.5-7b_auto", "qwen2.5-7b_auto_online", "llama3.1-8b_fp8",
                                             "llama3.1-8b_auto_online"]
    assert [len(cs) for _, cs in groups] == [1, 1, 2, 1]

    monkeypatch.setenv("TK_SERVE_IMPLS", "triton_attn,tk")
    monkeypatch.setenv("TK_SERVE_REPEATS", "2")
    assert serve.selected_impls("llama3.1-8b") == ["tk", "triton_attn"] and serve.rounds("bge-base") == 2


def test_unknown_names_are_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv("TK_SERVE_MODELS", "llama3.1-8b,llama-70b")
    with pytest.raises(SystemExit, match=r"TK_SERVE_MODELS names unknown models \['llama-70b'\]; choose from "
                                         r"\['llama3-8b-4l', 'llama3.1-8b'"):
        serve.selected_models()
    monkeypatch.setenv("TK_SERVE_CASES", "decode,prefil")
    with pytest.raises(SystemExit, match=r"TK_SERVE_CASES names \['prefil'\], which match no case of the models "
                                         r"run \(llama3.1-8b; TK_SERVE_MODELS picks them\); choose kinds from"):
        serve.selected_cases(["llama3.1-8b"])
    # a real case of a model not selected is refused too (it would not run)
    monkeypatch.setenv("TK_SERVE_CASES", "qwen2.5-7b_decode_128x512in_512out")
    with pytest.raises(SystemExit, match="qwen2.5-7b_decode_128x512in_512out"):
        serve.selected_cases(["llama3.1-8b"])
    monkeypatch.setenv("TK_SERVE_CASES", "embed_fp8")
    with pytest.raises(SystemExit, match="embed_fp8"):
        serve.selected_cases(["bge-base"])
    monkeypatch.setenv("TK_SERVE_IMPLS", "tk,fa3")
    with pytest.raises(SystemExit, match=r"TK_SERVE_IMPLS names unknown impls \['fa3'\]"):
        serve.selected_impls("llama3.1-8b")


def test_run_refuses_a_bad_selection_before_starting_anything(monkeypatch):
    monkeypatch.setenv("TK_SERVE_MODELS", "gemma-2-9b")
    monkeypatch.setattr(serve, "Engine", lambda *a, **k: pytest.fail("an engine was started"))
    with pytest.raises(SystemExit, match="gemma-2-9b"):
        serve.run()


# ----------------------------------------------------------------------------------------- engine settings


def test_the_4_layer_engines_keep_their_settings():
    assert serve.engine_kwargs("llama3-8b-4l", "/m", "TK", 2) == dict(
        model="/m", attention_backend="TK", tensor_parallel_size=2, seed=0, max_model_len=serve.MAX_MODEL_LEN,
        max_num_seqs=256, gpu_memory_utilization=0.15, kv_cache_memory_bytes=8 * GiB, enable_prefix_caching=False,
        enforce_eager=False)


def test_flash_attn_full_is_flash_attn_with_full_graphs_for_mixed_batches():
    plain = serve.engine_kwargs("llama3.1-8b", "/m", serve.IMPLS["flash_attn"], 1)
    full = serve.engine_kwargs("llama3.1-8b", "/m", serve.IMPLS["flash_attn_full"], 1)
    assert full == {**plain, "compilation_config": {"cudagraph_mode": "FULL"}}
    assert full["attention_backend"] == "FLASH_ATTN" and "compilation_config" not in plain
    command = serve.server_command("llama3.1-8b", "/m", serve.IMPLS["flash_attn_full"], 1, 8000)
    at = command.index("--compilation-config")
    assert json.loads(command[at + 1]) == {"cudagraph_mode": "FULL"}
    assert "flash_attn_full" not in serve.selected_impls("llama3-8b-4l")  # only where TK_SERVE_IMPLS names it


def test_full_size_engines_take_dummy_weights_token_ids_and_their_fixed_cache():
    common = dict(model="/m", tensor_parallel_size=1, seed=0, max_model_len=32768, max_num_seqs=256,
                  gpu_memory_utilization=0.15, enable_prefix_caching=False, enforce_eager=False, load_format="dummy",
                  dtype="bfloat16", skip_tokenizer_init=True)
    for impl in ("tk", "flash_attn"):  # every impl's engine alike but for the backend
        backend = serve.IMPLS[impl]
        assert serve.engine_kwargs("llama3.1-8b", "/m", backend, 1) == {
            **common, "attention_backend": backend, "kv_cache_memory_bytes": 36 * GiB}
        assert serve.engine_kwargs("llama3.1-8b", "/m", backend, 1, "fp8") == {
            **common, "attention_backend": backend, "kv_cache_memory_bytes": 18 * GiB, "kv_cache_dtype": "fp8"}
        assert serve.engine_kwargs("llama3.1-8b", "/m", backend, 1, online=True) == {
            **common, "attention_backend": backend, "kv_cache_memory_bytes": 20 * GiB}
    assert serve.engine_kwargs("gemma2-9b", "/m", "TK", 1)["kv_cache_memory_bytes"] == 40 * GiB
    assert serve.engine_kwargs("bge-base", "/m", "TRITON_ATTN", 1) == dict(
        model="/m", attention_backend="TRITON_ATTN", tensor_parallel_size=1, seed=0, max_model_len=512,
        max_num_seqs=256, gpu_memory_utilization=0.15, kv_cache_memory_bytes=1 * GiB, enable_prefix_caching=False,
        enforce_eager=False, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=False, runner="pooling",
        max_num_batched_tokens=16384, enable_chunked_prefill=False)


def test_the_worker_builds_its_llm_from_those_settings(monkeypatch, tmp_path):
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128256}))
    llm, vocab = serve.engine(str(tmp_path), "TK", 1, serve_model="llama3.1-8b", kv_cache_dtype="fp8")
    assert isinstance(llm, FakeLLM) and vocab == 128256
    assert seen == serve.engine_kwargs("llama3.1-8b", tmp_path, "TK", 1, "fp8")


def test_every_setting_is_an_engine_argument():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for c in serve.CASE_TABLE:
        kwargs = serve.engine_kwargs(c.model, "/m", "TK", 1, c.kv_cache_dtype, c.online, c.prefix_caching)
        assert set(kwargs) <= fields, (c.name, set(kwargs) - fields)


# Parses the bench's `vllm serve` command with vLLM's own parser (on a CPU platform: the parser's defaults need a
# device) and prints the engine arguments it makes, and the server's, as JSON.
_PARSE_SERVE = textwrap.dedent("""
    import json, sys
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform
    vllm.platforms._current_platform = CpuPlatform()
    from vllm.engine.arg_utils import EngineArgs
    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    command = json.loads(sys.argv[1])
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(command[command.index("serve") + 1:])
    engine = EngineArgs.from_cli_args(args)
    keys = json.loads(sys.argv[2])
    print(json.dumps({"engine": {k: str(getattr(engine, k)) for k in keys}, "model": args.model_tag,
                      "host": args.host, "port": args.port, "served": args.served_model_name}))
""")


def test_the_server_flags_parse_to_the_engine_settings():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    command = serve.server_command("llama3.1-8b", "/m", "FLASH_ATTN", 1, 8123)
    assert command[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    assert "--no-enable-prefix-caching" in command and "--skip-tokenizer-init" in command
    kwargs = serve.engine_kwargs("llama3.1-8b", "/m", "FLASH_ATTN", 1, online=True)
    kwargs.pop("model")
    out = subprocess.run([sys.executable, "-c", _PARSE_SERVE, json.dumps(command), json.dumps(list(kwargs))],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed["model"] == "/m" and (parsed["host"], parsed["port"], parsed["served"]) == (
        "127.0.0.1", 8123, ["llama3.1-8b"])
    assert parsed["engine"].pop("attention_backend").endswith("FLASH_ATTN")
    assert parsed["engine"] == {k: str(v) for k, v in kwargs.items() if k != "attention_backend"}


# ------------------------------------------------------------------------------------------------------ rows


def test_rows_are_medians_of_the_runs_and_short_runs_are_dropped(capsys):
    decode = serve.ALL_CASES["llama3.1-8b_decode_128x512in_512out"]
    replies = [{"seconds": s, "tokens": 65536} for s in (8.0, 6.0, 7.0)]
    row = serve.case_row(decode, "tk", replies, "_tp2", 36 * GiB)
    assert (row.kernel, row.case, row.impl, row.median_ms) == ("serve", "llama3.1-8b_decode_128x512in_512out_tp2",
                                                               "tk", 7000.0)
    assert row.extra == {"tok_s": round(65536 / 7.0, 1), "tokens": 65536, "runs_s": [8.0, 6.0, 7.0],
                         "kv_cache_gib": 36.0}
    # the 4-layer rows keep their fields
    old = serve.case_row(serve.ALL_CASES["offline_64x128in_1024out"], "tk", [{"seconds": 2.0, "tokens": 65536}])
    assert old.extra == {"tok_s": 32768.0, "tokens": 65536, "runs_s": [2.0]}
    assert serve.case_row(decode, "tk", [*replies, {"seconds": 5.0, "tokens": 65000}]) is None
    assert "runs fell short of 65536 tokens: 65000 tokens" in capsys.readouterr().out

    embed = serve.ALL_CASES["bge-base_embed_1024x64-512in"]
    replies = [{"seconds": s, "tokens": embed.expected_tokens, "requests": 1024} for s in (0.5, 0.4)]
    row = serve.case_row(embed, "flash_attn", replies, "", GiB)
    assert row.median_ms == 450.0 and row.extra["req_s"] == round(1024 / 0.45, 1)
    assert row.extra["requests"] == 1024 and row.extra["runs_s"] == [0.5, 0.4] and "tok_s" not in row.extra
    assert serve.case_row(embed, "tk", [{**replies[0], "requests": 1000}]) is None

    online = serve.ALL_CASES["llama3.1-8b_online_256x128-2048in_256out_8rps"]
    runs = [{"seconds": 36.0 + i, "tokens": 65536, "failed": 0, "ttft_p50_ms": 80.0 + i, "ttft_p99_ms": 300.0 + i,
             "tpot_p50_ms": 12.0 + i, "tpot_p99_ms": 20.0 + i} for i in (2, 0, 1)]
    row = serve.case_row(online, "tk", runs, "", 20 * GiB)
    assert row.median_ms == 13.0 and row.note == "median_ms: TPOT p50"
    assert {k: row.extra[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")} == {
        "ttft_p50_ms": 81.0, "ttft_p99_ms": 301.0, "tpot_p50_ms": 13.0, "tpot_p99_ms": 21.0}
    assert row.extra["runs"][0] == {"seconds": 38.0, "ttft_p50_ms": 82.0, "ttft_p99_ms": 302.0, "tpot_p50_ms": 14.0,
                                    "tpot_p99_ms": 22.0}
    assert "tok_s" not in row.extra  # the table and the picture rank online rows by 1 / median_ms
    assert serve.case_row(online, "tk", [{**runs[0], "failed": 2, "tokens": 65024, "first_error": "HTTP 500"}]) is None
    assert "HTTP 500" in capsys.readouterr().out


def test_an_engine_that_does_not_start_is_recorded_and_the_others_run(tmp_path):
    import os

    from tests.cpu.test_bench_results import _FAKE_SERVE_WORKER

    script, order_log = tmp_path / "fake_worker.py", tmp_path / "order.log"
    script.write_text(_FAKE_SERVE_WORKER)
    engines = [serve.Engine("a", [sys.executable, str(script), str(order_log), "a", "0"], dict(os.environ), tmp_path),
               serve.Engine("broken", [sys.executable, "-c", "import sys; print('no GPU'); sys.exit(5)"],
                            dict(os.environ), tmp_path),
               serve.Engine("b", [sys.executable, str(script), str(order_log), "b", "0"], dict(os.environ), tmp_path)]
    failures = []
    try:
        runs = serve.interleaved_runs(engines, ["x"], repeats=2, record=dict, failures=failures)
    finally:
        for e in engines:
            e.close()
    assert sorted(runs) == ["a", "b"] and all(len(runs[i]["x"]) == 2 for i in runs)
    assert runs["a"]["x"][0] == {"case": "x", "seconds": 0.51, "tokens": 7}
    assert len(failures) == 1 and failures[0].startswith("broken: the worker exited (5)") and "no GPU" in failures[0]


# ----------------------------------------------------------------------------------------------------- online

# A stand-in for vLLM's OpenAI server: /health, and streamed /v1/completions that send the first chunk after
# FIRST_S and the others STEP_S apart (empty text, as with --skip-tokenizer-init), then the usage chunk (no
# choices) and [DONE]. A prompt starting with token 13 gets HTTP 500. argv: --port N (and vllm serve's flags).
FIRST_S, STEP_S = 0.06, 0.01
_STAND_IN = textwrap.dedent(f"""
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert request["stream"] and request["ignore_eos"] and request["stream_options"]["include_usage"]
            if request["prompt"][0] == 13:
                self.send_response(500)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep({FIRST_S})
            for i in range(request["max_tokens"]):
                if i:
                    time.sleep({STEP_S})
                chunk = {{"model": request["model"], "choices": [{{"index": 0, "text": ""}}]}}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\\n\\n")
                self.wfile.flush()
            usage = {{"choices": [], "usage": {{"prompt_tokens": len(request["prompt"]),
                                                 "completion_tokens": request["max_tokens"]}}}}
            self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\\n\\ndata: [DONE]\\n\\n")

    port = int(sys.argv[sys.argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


@pytest.fixture
def stand_in(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    from serve_demo import free_port, wait_ready

    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    port = free_port()
    server = subprocess.Popen([sys.executable, str(script), "--port", str(port)])
    try:
        wait_ready(f"http://127.0.0.1:{port}", server, 30)
        yield port
    finally:
        server.kill()
        server.wait()


def test_the_online_client_measures_ttft_and_tpot_as_vllm_bench_serve(stand_in):
    one = serve.stream_completion("127.0.0.1", stand_in, {"model": "m", "prompt": [20, 21], "max_tokens": 5,
                                                          "ignore_eos": True, "stream": True,
                                                          "stream_options": {"include_usage": True}})
    assert one["tokens"] == 5 and FIRST_S <= one["ttft"] < FIRST_S + 0.5
    assert 4 * STEP_S <= one["latency"] - one["ttft"] < 4 * STEP_S + 0.5
    prompts = [[20] * 8 for _ in range(6)] + [[13, 20]]
    summary = serve.online_load("127.0.0.1", stand_in, "m", prompts, 4, rate=50.0)
    assert summary["failed"] == 1 and summary["tokens"] == 6 * 4 and "HTTP 500" in summary["first_error"]
    assert FIRST_S <= summary["ttft_p50_ms"] / 1e3 <= summary["ttft_p99_ms"] / 1e3 < FIRST_S + 0.5
    assert STEP_S <= summary["tpot_p50_ms"] / 1e3 <= summary["tpot_p99_ms"] / 1e3 < STEP_S + 0.2
    assert summary["seconds"] >= FIRST_S + 3 * STEP_S


def test_online_arrivals_are_a_seeded_poisson_process():
    offsets = serve.arrival_offsets(4000, 8.0, seed=7)
    assert offsets == serve.arrival_offsets(4000, 8.0, seed=7) and offsets[0] == 0.0
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert all(g > 0 for g in gaps) and abs(sum(gaps) / len(gaps) - 1 / 8) < 0.01
    assert serve.arrival_offsets(5, 0.0, seed=7) == [0.0] * 5


def test_the_online_worker_serves_the_protocol_and_stops_its_server(tmp_path, monkeypatch):
    """online_worker with `vllm serve` replaced by the stand-in: ready after the server's health and a warm-up,
    one reply a case with the load's figures, and the server gone after quit."""
    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    started = []

    def command(name, model_dir, backend, tp, port, kv_cache_dtype="auto"):
        started.append((name, backend, kv_cache_dtype))
        return [sys.executable, str(script), "--port", str(port)]

    case = dataclasses.replace(serve.ALL_CASES["llama3.2-1b_online_256x128-2048in_256out_8rps"], prompts=5,
                               prompt_len=(4, 9), new_tokens=3, rate=100.0)
    monkeypatch.setattr(serve, "server_command", command)
    monkeypatch.setitem(serve.ALL_CASES, case.name, case)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{case.name}\nquit\n"))
    popen = subprocess.Popen
    servers = []
    monkeypatch.setattr(serve.subprocess, "Popen", lambda *a, **k: servers.append(popen(*a, **k)) or servers[-1])
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    replies = tmp_path / "tk.replies"
    serve.online_worker(str(tmp_path), "TK", 1, str(replies), "llama3.2-1b")
    assert started == [("llama3.2-1b", "TK", "auto")]
    ready, run = [json.loads(line) for line in replies.read_text().splitlines()]
    assert ready == {"ready": True}
    assert run["case"] == case.name and run["tokens"] == 15 and run["failed"] == 0
    assert run["tpot_p50_ms"] >= STEP_S * 1e3 and run["ttft_p99_ms"] >= FIRST_S * 1e3
    assert len(servers) == 1 and servers[0].poll() is not None


# ------------------------------------------------------------------------------------------ Mamba-2 models


def test_the_mamba_models_have_their_own_cases():
    for model in MAMBA:
        cases = [c for c in serve.CASE_TABLE if c.model == model]
        assert [c.name for c in cases] == [f"{model}_prefill_32x8192in_64out", f"{model}_decode_128x512in_512out",
                                           f"{model}_prefix_64x4096+512in_64out"]
        prefill, decode, prefix = cases
        assert (prefill.prompts, prefill.prompt_len, prefill.new_tokens, prefill.prefix_caching) == (32, 8192, 64, False)
        assert (decode.prompts, decode.prompt_len, decode.new_tokens, decode.prefix_caching) == (128, 512, 512, False)
        assert (prefix.prompts, prefix.shared_prefix, prefix.prompt_len, prefix.new_tokens) == (64, 4096, 512, 64)
        assert prefix.prefix_caching and prefix.longest_prompt == 4608 and prefix.expected_tokens == 64 * 64
        m = serve.MODELS[model]
        assert m.mamba and m.impls == ("tk", "flash_attn") and m.max_num_seqs == 128 >= max(c.prompts for c in cases)
        assert prefill.longest_prompt + prefill.new_tokens == 8256 <= m.max_model_len == 16384


def test_the_prefix_case_prompts_share_their_prefix_and_nothing_else():
    prefix = serve.ALL_CASES["nemotron-h-8b_prefix_64x4096+512in_64out"]
    prompts = serve.case_prompts(prefix, 131072)
    assert len(prompts) == 64 and {len(p) for p in prompts} == {4608}
    assert len({tuple(p[:4096]) for p in prompts}) == 1 and len({tuple(p[4096:]) for p in prompts}) == 64
    assert prompts == serve.case_prompts(prefix, 131072) and all(16 <= t < 131072 for p in prompts for t in p)
    decode = serve.ALL_CASES["nemotron-h-8b_decode_128x512in_512out"]  # no prefix: _prompts' own prompts
    assert serve.case_prompts(decode, 1000) == serve._prompts(128, 512, 1000, seed=serve.PROMPT_SEED)


def test_mamba_models_are_picked_by_name_and_kind(monkeypatch):
    models = _select_models(monkeypatch, "falcon-h1-1.5b,mamba2-2.7b")
    assert models == ["falcon-h1-1.5b", "mamba2-2.7b"]
    groups = serve.plan(serve.selected_cases(models))  # every kind by default; prefix caching engines of their own
    assert [(g.label, [c.kind for c in cs]) for g, cs in groups] == [
        ("falcon-h1-1.5b_auto", ["prefill", "decode"]), ("falcon-h1-1.5b_auto_prefix", ["prefix"]),
        ("mamba2-2.7b_auto", ["prefill", "decode"]), ("mamba2-2.7b_auto_prefix", ["prefix"])]
    assert serve.selected_impls("mamba2-2.7b") == ["tk", "flash_attn"] and serve.rounds("mamba2-2.7b") == 3
    monkeypatch.setenv("TK_SERVE_CASES", "prefix,mamba2-2.7b_decode_128x512in_512out")
    assert [c.name for c in serve.selected_cases(models)] == [
        "falcon-h1-1.5b_prefix_64x4096+512in_64out", "mamba2-2.7b_decode_128x512in_512out",
        "mamba2-2.7b_prefix_64x4096+512in_64out"]
    monkeypatch.setenv("TK_SERVE_CASES", "long")  # the Mamba models have no long case
    with pytest.raises(SystemExit, match=r"TK_SERVE_CASES names \['long'\]"):
        serve.selected_cases(models)


# model -> (attention layers, kv heads, head size), Mamba-2 layers, the state a layer keeps for a sequence: conv
# 3 x (heads x head dim + 2 x groups x state) x 2 bytes, SSM heads x head dim x state x (2 bytes; Nemotron-H's 4)
MAMBA_SHAPES = {
    "mamba2-2.7b": ((0, 0, 0), 64, 3 * (80 * 64 + 2 * 1 * 128) * 2 + 80 * 64 * 128 * 2),
    "nemotron-h-8b": ((4, 8, 128), 24, 3 * (128 * 64 + 2 * 8 * 128) * 2 + 128 * 64 * 128 * 4),
    "falcon-h1-1.5b": ((24, 2, 128), 24, 3 * (48 * 64 + 2 * 1 * 256) * 2 + 48 * 64 * 256 * 2),
}


@pytest.mark.parametrize("model", MAMBA)
def test_mamba_state_and_kv_bytes(model):
    attention, mamba_layers, per_layer = MAMBA_SHAPES[model]
    assert serve.model_shape(model) == attention
    assert serve.kv_bytes_per_token(model) == attention[0] * 2 * attention[1] * attention[2] * 2
    assert serve.mamba_state_bytes(model) == mamba_layers * per_layer
    assert serve.mamba_state_bytes("llama3.1-8b") == 0
    for case in (c for c in serve.CASE_TABLE if c.model == model):
        held = min(case.prompts, 128)
        states = (3 if case.prefix_caching else 1) * mamba_layers * per_layer
        assert serve.case_cache_bytes(case) == case.peak_tokens * serve.kv_bytes_per_token(model) + held * (
            states + attention[0] * per_layer)
        group = serve.Group(model, prefix_caching=case.prefix_caching)
        size = serve.kv_cache_bytes(group)
        assert size >= serve.case_cache_bytes(case) * 1.1 and size >= 128 * mamba_layers * per_layer * 1.1
        assert size < serve.KV_CACHE_CAP_BYTES  # none capped: the floor of max_num_seqs states always holds


def test_the_mamba_caches_are_the_docstring_table():
    G = serve.Group
    gib = {m: (serve.kv_cache_bytes(G(m)) // GiB, serve.kv_cache_bytes(G(m, prefix_caching=True)) // GiB)
           for m in MAMBA}
    assert gib == {"mamba2-2.7b": (12, 17), "nemotron-h-8b": (18, 27), "falcon-h1-1.5b": (14, 18)}
    # Mamba2-2.7B's 128 decode sequences hold 128 x 64 x 1.28 MiB of state: 10.25 GiB, x 1.1 -> 12 GiB
    assert round(serve.mamba_state_bytes("mamba2-2.7b") * 128 / GiB, 2) == 10.25
    for model, (offline, prefix) in gib.items():
        line = next(ln for ln in serve.__doc__.splitlines() if ln.strip().startswith(model + " ") and "KiB" in ln)
        assert f"{serve.kv_bytes_per_token(model) // KiB} KiB" in line and f"{offline} GiB (prefix: {prefix})" in line


def test_mamba_engines_cache_prefixes_only_for_the_prefix_case_and_pick_the_ssd_by_impl():
    common = dict(model="/m", tensor_parallel_size=1, seed=0, max_model_len=16384, max_num_seqs=128,
                  gpu_memory_utilization=0.15, enforce_eager=False, load_format="dummy", dtype="bfloat16",
                  skip_tokenizer_init=True)
    for impl in ("tk", "flash_attn"):
        backend = serve.IMPLS[impl]
        assert serve.engine_kwargs("nemotron-h-8b", "/m", backend, 1) == {
            **common, "attention_backend": backend, "kv_cache_memory_bytes": 18 * GiB, "enable_prefix_caching": False}
        assert serve.engine_kwargs("nemotron-h-8b", "/m", backend, 1, prefix_caching=True) == {
            **common, "attention_backend": backend, "kv_cache_memory_bytes": 27 * GiB, "enable_prefix_caching": True}
    env = {"TK_MAMBA": "1", "PATH": "/bin"}  # whatever the caller exported, each impl gets its own SSD
    assert serve.engine_env(env, "falcon-h1-1.5b", "tk") == {  # a TK user's default: TK_MAMBA unset
        "PATH": "/bin", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert serve.engine_env(env, "falcon-h1-1.5b", "flash_attn")["TK_MAMBA"] == "0"
    assert serve.engine_env(env, "llama3.1-8b", "flash_attn") is env  # attention-only models as before
    prefix_group = serve.plan([serve.ALL_CASES["mamba2-2.7b_prefix_64x4096+512in_64out"]])[0][0]
    command = serve.worker_command(prefix_group, Path("/m"), "TK", 1)
    assert command[-1] == "--prefix-caching" and "--online" not in command
    assert "--prefix-caching" not in serve.worker_command(serve.Group("mamba2-2.7b"), Path("/m"), "TK", 1)


def test_tk_stats_are_summed_over_workers_and_kept_in_the_row():
    class FakeLLM:
        def collective_rpc(self, method):
            assert method is serve._read_tk_stats
            return [{"tk_scan": 3, "tk_update": 2}, {"tk_scan": 1, "fallback_scan": 1}, {}]

    assert serve.tk_stats(FakeLLM()) == {"fallback_scan": 1, "tk_scan": 4, "tk_update": 2}
    assert set(serve._read_tk_stats(None)) <= {"tk_scan", "tk_update", "fallback_scan", "fallback_update",
                                               "vllm_scan", "vllm_update"}
    case = serve.ALL_CASES["mamba2-2.7b_decode_128x512in_512out"]
    replies = [{"seconds": 5.0, "tokens": 65536, "tk_stats": {"tk_scan": 10}},
               {"seconds": 4.0, "tokens": 65536, "tk_stats": {"tk_scan": 20}}]
    row = serve.case_row(case, "tk", replies, "", 12 * GiB)
    assert row.extra["tk_stats"] == {"tk_scan": 20} and row.extra["kv_cache_gib"] == 12.0


@pytest.mark.parametrize("preset, fields", [
    ("mamba2-2.7b", dict(model_type="mamba2", architectures=["Mamba2ForCausalLM"], num_hidden_layers=64,
                         hidden_size=2560, num_heads=80, head_dim=64, expand=2, state_size=128, n_groups=1,
                         vocab_size=50288, tie_word_embeddings=True)),
    ("nemotron-h-8b", dict(model_type="nemotron_h", architectures=["NemotronHForCausalLM"], num_hidden_layers=52,
                           hidden_size=4096, hybrid_override_pattern=build_model_configs.NEMOTRON_H_8B_PATTERN,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
                           mamba_head_dim=64, ssm_state_size=128, n_groups=8, intermediate_size=21504,
                           mlp_hidden_act="relu2", vocab_size=131072, max_position_embeddings=8192)),
    ("falcon-h1-1.5b", dict(model_type="falcon_h1", architectures=["FalconH1ForCausalLM"], num_hidden_layers=24,
                            hidden_size=2048, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                            mamba_d_ssm=3072, mamba_n_heads=48, mamba_d_head=64, mamba_d_state=256,
                            mamba_n_groups=1, intermediate_size=4608, vocab_size=65537)),
])
def test_the_mamba_configs_have_the_release_shapes(preset, fields):
    cfg = build_model_configs.config(preset)
    for field, value in fields.items():
        assert getattr(cfg, field) == value, field
    pattern = build_model_configs.NEMOTRON_H_8B_PATTERN
    assert (len(pattern), pattern.count("M"), pattern.count("*"), pattern.count("-")) == (52, 24, 4, 24)
    assert build_model_configs.config(preset, 5).num_hidden_layers == 5


def test_vllm_reads_the_mamba_configs_and_sizes_their_states_as_the_bench(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from types import SimpleNamespace

    import torch
    from vllm.config import ModelConfig
    from vllm.model_executor.models.falcon_h1 import FalconH1ForCausalLM
    from vllm.model_executor.models.mamba2 import Mamba2ForCausalLM
    from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM

    classes = {"mamba2-2.7b": Mamba2ForCausalLM, "nemotron-h-8b": NemotronHForCausalLM,
               "falcon-h1-1.5b": FalconH1ForCausalLM}
    monkeypatch.setattr(serve.tempfile, "gettempdir", lambda: str(tmp_path))
    for name in MAMBA:
        path = serve.build_model(name)
        config = ModelConfig(model=str(path), runner="generate", max_model_len=16384, skip_tokenizer_init=True,
                             dtype="bfloat16")
        assert config.max_model_len == 16384 and config.architecture == classes[name].__name__
        assert config.is_hybrid == (name != "mamba2-2.7b")
        assert serve.prompt_vocab(name, path) == config.get_vocab_size()
        if name != "mamba2-2.7b":
            assert config.get_head_size() == serve.model_shape(name)[2]
            assert config.get_total_num_kv_heads() == serve.model_shape(name)[1]
        # the state vLLM pages for one Mamba layer (the SSM cache in float32 for Nemotron-H, as vLLM sets it)
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(hf_config=config.hf_config, dtype=torch.bfloat16),
            parallel_config=SimpleNamespace(tensor_parallel_size=1), num_speculative_tokens=0,
            cache_config=SimpleNamespace(mamba_cache_dtype="auto", use_replayssm=False,
                                         mamba_ssm_cache_dtype="float32" if name == "nemotron-h-8b" else "auto"))
        shapes = classes[name].get_mamba_state_shape_from_config(vllm_config)
        dtypes = classes[name].get_mamba_state_dtype_from_config(vllm_config)
        page = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes))
        assert page == MAMBA_SHAPES[name][2] and page * MAMBA_SHAPES[name][1] == serve.mamba_state_bytes(name)
    # Nemotron-H is built with more positions than its release (8192), which vLLM would refuse otherwise
    short = build_model_configs.build(tmp_path / "nemotron-release", "nemotron-h-8b")
    with pytest.raises(Exception, match="max_model_len"):
        ModelConfig(model=str(short), runner="generate", max_model_len=16384, skip_tokenizer_init=True)
