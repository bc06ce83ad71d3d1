"""The model shapes of tests/gpu/test_vllm_models.py on CPU: examples/build_model_configs.py writes configs that
transformers and the installed vLLM read as those models (architecture, heads, head size, windows, attention
type), the TK backend's selector hooks and impl accept each of their layers as vLLM would build it, the shape the
GPU test expects refused is refused with the sentence it expects, and the workers' weight redraw is what its
docstring says. Skipped when vLLM is not importable.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install_cpu_vllm.sh installs it)")

from vllm.platforms.interface import DeviceCapability  # noqa: E402

from tests.gpu import test_vllm_models as gpu_models  # noqa: E402
from tk_backend.vllm.backend import TKAttentionBackend, TKAttentionImpl, TKUnsupportedError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import build_model_configs  # noqa: E402

# preset -> (vLLM runner, attention type, q heads, kv heads, head size, each layer's sliding window, sinks)
EXPECTED = {
    "phi3-mini": ("generate", "decoder", 32, 32, 96, [2047] * 4, False),
    "gpt-oss-20b": ("generate", "decoder", 64, 8, 64, [128, None, 128, None], True),
    "bge-base": ("pooling", "encoder_only", 12, 12, 64, [None] * 4, False),
    # the serve bench's full-size models (scripts/benches/serve.py)
    "llama3.1-8b": ("generate", "decoder", 32, 8, 128, [None] * 4, False),
    "llama3.2-1b": ("generate", "decoder", 32, 8, 64, [None] * 4, False),
    "qwen2.5-7b": ("generate", "decoder", 28, 4, 128, [None] * 4, False),
    "gemma2-9b": ("generate", "decoder", 16, 8, 256, [4096, None, 4096, None], False),
}


def _model_config(path: Path, runner: str, max_model_len: int):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(path), runner=runner, max_model_len=max_model_len, skip_tokenizer_init=True,
                       dtype="bfloat16")


def _selector(head_size: int, attn_type: str, window, sinks: bool) -> dict:
    """What vLLM's Attention layer asks the selector for such a layer."""
    return dict(head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=False,
                has_sink=sinks, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=DeviceCapability(9, 0), attn_type=attn_type, has_sliding_window=window is not None)


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_configs_are_the_models_and_tk_accepts_every_layer(tmp_path, preset):
    runner, attn_type, heads, kv_heads, head_size, windows, sinks = EXPECTED[preset]
    path = build_model_configs.build(tmp_path / preset, preset, layers=4)
    assert build_model_configs.build(tmp_path / preset, preset, layers=4) == path  # idempotent
    config = _model_config(path, runner, 512 if preset == "bge-base" else 2048)
    assert config.architectures == list(build_model_configs.config(preset, 4).architectures)
    assert config.attn_type == attn_type
    assert config.get_head_size() == head_size and config.get_total_num_kv_heads() == kv_heads
    assert config.hf_config.num_attention_heads == heads
    if preset == "gpt-oss-20b":  # vLLM windows every other layer (gpt_oss.py: layer_idx % 2 == 0)
        assert config.hf_config.sliding_window == 128 and config.hf_config.num_local_experts == 32
    else:
        assert config.get_sliding_window() == windows[0]
    for window in windows:
        assert TKAttentionBackend.validate_configuration(**_selector(head_size, attn_type, window, sinks)) == []
        layer_sinks = torch.zeros(heads, dtype=torch.bfloat16) if sinks else None
        impl = TKAttentionImpl(heads, head_size, head_size**-0.5, kv_heads, None, window, "auto", None, attn_type,
                               None, sinks=layer_sinks)
        if window is None:
            assert impl.window_size == (-1, -1)
        else:  # vLLM's window w: w - 1 keys back (and forward, for an encoder-only layer)
            assert impl.window_size == (window - 1, window - 1 if attn_type == "encoder_only" else 0)


def test_the_release_layer_counts_and_the_layers_cut(tmp_path):
    assert [build_model_configs.config(p).num_hidden_layers for p in ("phi3-mini", "bge-base", "gpt-oss-20b")] == \
        [32, 12, 24]
    assert build_model_configs.config("gpt-oss-20b", 3).layer_types == [
        "sliding_attention", "full_attention", "sliding_attention"]
    with pytest.raises(ValueError, match="layers must be between 1 and 32 for phi3-mini, got 33"):
        build_model_configs.config("phi3-mini", 33)
    with pytest.raises(ValueError, match="preset must be one of"):
        build_model_configs.config("llama")


def test_the_refused_shape_is_refused_with_the_sentence_the_gpu_test_expects(tmp_path):
    spec = gpu_models.MODELS["phi3-hd100"]
    path = build_model_configs.build(tmp_path / "hd100", spec["preset"], spec["layers"], **spec["overrides"])
    config = _model_config(path, "generate", 2048)
    assert config.get_head_size() == 100
    with pytest.raises(TKUnsupportedError) as refused:
        TKAttentionBackend.validate_configuration(**_selector(100, "decoder", 2047, False))
    assert str(refused.value) == gpu_models.HD100_REFUSAL


def test_realistic_weights_are_seeded_by_name_and_shaped_by_role():
    def model():
        m = torch.nn.Module()
        m.proj = torch.nn.Linear(256, 64, bias=True)
        m.norm = torch.nn.LayerNorm(64)
        m.lm_head = torch.nn.Linear(256, 1000, bias=False)
        m.sinks = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
        m.register_buffer("steps", torch.zeros(3, dtype=torch.long))
        return m

    with torch.no_grad():
        a, b = model(), model()
        torch.nn.init.zeros_(b.proj.weight)  # whatever the weights were before
        assert gpu_models.realistic_weights(a) == gpu_models.realistic_weights(b) == 6
        for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(x, y), name
        assert abs(float(a.proj.weight.std()) - 256**-0.5) < 0.1 * 256**-0.5
        assert abs(float(a.lm_head.weight.std()) - 4 * 256**-0.5) < 0.1 * 4 * 256**-0.5
        assert abs(float(a.norm.weight.mean()) - 1.0) < 0.05 and float(a.norm.bias.abs().max()) < 0.2
        assert 1.0 < float(a.sinks.std()) < 3.0
        assert not torch.equal(a.proj.weight[:, :64], a.lm_head.weight[:64, :64])  # not one stream for all


def test_prompts_fit_the_context_and_share_a_prefix():
    prompts = gpu_models._prompts(30522, 32, 486)
    assert len(prompts) == 32 and all(16 <= t < 30522 for p in prompts for t in p)
    assert max(map(len, prompts)) <= 486 and min(map(len, prompts)) >= 8
    assert prompts[0][:200] == prompts[4][:200]


@pytest.mark.parametrize("preset", ["nemotron-h-tiny", "falcon-h1-tiny"])
def test_the_mamba_e2e_hybrids_are_what_vllm_reads_with_weights_under_the_release_names(tmp_path, preset):
    """tests/gpu/test_vllm_mamba_e2e.py's hybrid models: vLLM reads the cut-down config as the hybrid (its layer
    pattern, state size, groups), and the random weights are stored under the release's tensor names (vLLM's
    loaders map those: Nemotron-H's `backbone.`), seeded (the same file twice) and with a scaled LM head."""
    from safetensors import safe_open

    from tests.gpu import test_vllm_mamba_e2e as e2e

    path = e2e._model(tmp_path, preset)
    config = _model_config(path, "generate", 2048)
    hf = config.hf_config
    assert config.is_hybrid and config.get_head_size() == 128 and config.get_total_num_kv_heads() == 2
    if preset == "nemotron-h-tiny":
        assert hf.hybrid_override_pattern == "M-M-M-M*-M" and hf.ssm_state_size == 128 and hf.n_groups == 8
        assert hf.mamba_num_heads * hf.mamba_head_dim == 2 * hf.hidden_size
        prefix = "backbone."
    else:
        assert hf.num_hidden_layers == 4 and hf.mamba_d_state == 256 and hf.mamba_n_groups == 1
        assert hf.mamba_n_heads * hf.mamba_d_head == hf.mamba_d_ssm
        prefix = "model."
    assert e2e._state_size(path) == (128 if preset == "nemotron-h-tiny" else 256)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        head = f.get_tensor("lm_head.weight").float()
    assert all(n.startswith(prefix) or n == "lm_head.weight" for n in names), names[:5]
    assert 0.05 < head.std().item() < 0.2  # transformers' 0.02 initializer x HYBRID_LM_HEAD_SCALE
    stamp = (path / "weights.json").read_text()
    assert e2e._model(tmp_path, preset) == path and (path / "weights.json").read_text() == stamp  # not rebuilt
