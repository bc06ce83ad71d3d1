"""The Based model on CPU: config, transformers loading, forward and cached decoding on the float32 references,
the vLLM registration and state-cache layout, and the vLLM linear-attention layer's slot handling (chunked
prefill from the state cache, then decode) with the references standing in for the kernels."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tk_backend import based, reference
from tk_backend.models import BasedConfig, register
from tk_backend.models.modeling_based import (
    BasedCache,
    BasedForCausalLM,
    based_chunk_reference,
    window_attention_reference,
)

REPO = Path(__file__).resolve().parents[2]


def _small_config(**overrides) -> BasedConfig:
    kw = dict(vocab_size=320, hidden_size=128, intermediate_size=192, num_hidden_layers=4,
              mixer_types=["conv", "linear_attention", "sliding_attention", "conv"], num_attention_heads=4,
              num_key_value_heads=2, linear_attn_num_heads=2, sliding_window=6, conv_kernel=3)
    kw.update(overrides)
    return BasedConfig(**kw)


def _model(config: BasedConfig, seed: int = 0) -> BasedForCausalLM:
    torch.manual_seed(seed)
    model = BasedForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # a wider logit spread than the 0.02 init gives
    return model


# ------------------------------------------------------------------------------------------------ config


def test_config_round_trip(tmp_path):
    config = _small_config(tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "based" and saved["mixer_types"] == config.mixer_types
    loaded = BasedConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.head_dim == 32 and loaded.linear_attn_head_dim == 64 and loaded.conv_dim == 256


def test_config_defaults_and_validation():
    assert BasedConfig(num_hidden_layers=7).mixer_types == [
        "conv", "linear_attention", "sliding_attention", "conv", "conv", "conv", "linear_attention"]
    with pytest.raises(ValueError, match="mixer_types entries"):
        _small_config(mixer_types=["conv", "mamba", "conv", "conv"])
    with pytest.raises(ValueError, match="num_hidden_layers"):
        _small_config(mixer_types=["conv"])
    with pytest.raises(ValueError, match="linear_attn_num_heads"):
        _small_config(linear_attn_num_heads=3)


# ------------------------------------------------------------------------------------------ transformers


def test_auto_classes_load_from_a_local_dir(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    register()
    register()  # idempotent
    model = _model(_small_config())
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), BasedConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, BasedForCausalLM)
    ids = torch.randint(0, 320, (2, 11))
    torch.testing.assert_close(loaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_forward_shape_and_finite():
    model = _model(_small_config())
    ids = torch.randint(0, 320, (3, 17))
    out = model(ids, use_cache=False, labels=ids)
    assert out.logits.shape == (3, 17, 320) and torch.isfinite(out.logits).all()
    assert out.past_key_values is None and torch.isfinite(out.loss)
    assert model(ids, use_cache=False, logits_to_keep=1).logits.shape == (3, 1, 320)


def test_padding_is_refused():
    model = _model(_small_config())
    ids = torch.randint(0, 320, (2, 5))
    mask = torch.ones_like(ids)
    model(ids, attention_mask=mask)  # all ones: fine
    mask[0, 0] = 0
    with pytest.raises(NotImplementedError, match="padding"):
        model(ids, attention_mask=mask)


@pytest.mark.parametrize("chunks", [[9, 1, 1, 1, 1, 1], [4, 3, 1, 7, 1]])
def test_prefill_then_decode_equals_one_long_forward(chunks):
    # tied embeddings too, and a window shorter than the chunks
    model = _model(_small_config(tie_word_embeddings=True))
    ids = torch.randint(0, 320, (2, sum(chunks)))
    full = model(ids, use_cache=False).logits
    cache = BasedCache(model.config)
    pieces, start = [], 0
    for n in chunks:
        pieces.append(model(ids[:, start:start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    assert cache.get_seq_length() == ids.shape[1]
    assert all(k.shape[1] <= model.config.sliding_window - 1 for k, _ in cache.window.values())
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4)


def test_greedy_matches_argmax_of_full_forwards():
    model = _model(_small_config())
    prompt = torch.randint(0, 320, (1, 8))
    new = model.greedy(prompt, 6)
    seq = prompt
    for i in range(6):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        assert int(nxt) == int(new[0, i])
        seq = torch.cat([seq, nxt], 1)


def test_chunk_reference_continues_a_state():
    q, k = torch.randn(2, 13, 3, 16), torch.randn(2, 13, 3, 16)
    v = torch.randn(2, 13, 3, 64)
    whole = reference.based(q, k, v)
    first, state = based_chunk_reference(q[:, :5], k[:, :5], v[:, :5], None)
    second, state = based_chunk_reference(q[:, 5:], k[:, 5:], v[:, 5:], state)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-4, atol=1e-4)
    for got, want in zip(state, reference.based_prefill_state(k, v)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_window_reference_sees_itself_and_window_minus_one_keys():
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 10, 1, 8), torch.randn(1, 10, 1, 8)
    out = window_attention_reference(q, k, v, window=3, scale=0.5)
    for i in range(4):
        pos = 6 + i
        keys = slice(pos - 2, pos + 1)
        s = (q[0, i].float() * 0.5) @ k[0, keys, 0].T
        torch.testing.assert_close(out[0, i], s.softmax(-1) @ v[0, keys, 0])


def test_example_builds_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO / "examples"))
    from build_tiny_based import build

    register()
    path = build(tmp_path / "based", preset="tiny-based", vocab_size=2048)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.architectures == ["BasedForCausalLM"] and model.dtype == torch.bfloat16
    ids = tokenizer("The kernel reads a tile", return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits.float()).all()


# ------------------------------------------------------------------------------------------------- vLLM


def _vllm():
    return pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install_cpu_vllm.sh installs it)")


def test_vllm_registration_is_visible():
    _vllm()
    import tk_backend.vllm  # noqa: F401 (registers)
    from vllm import ModelRegistry

    assert "BasedForCausalLM" in ModelRegistry.get_supported_archs()
    cls = ModelRegistry._try_load_model_cls("BasedForCausalLM")
    from tk_backend.vllm.based_model import BasedForCausalLM as VllmBased

    assert cls is VllmBased
    from vllm.model_executor.models.interfaces import has_inner_state, is_hybrid

    assert is_hybrid(cls) and has_inner_state(cls)
    from transformers import AutoConfig

    assert AutoConfig.for_model("based").__class__ is BasedConfig


def _fake_vllm_config(config: BasedConfig, tp: int = 1):
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto"),
    )


def test_vllm_state_shapes():
    _vllm()
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from tk_backend.vllm.based_model import MOMENT_ROWS, BasedForCausalLM as VllmBased

    config = _small_config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=16,
                           linear_attn_num_heads=16)
    assert MOMENT_ROWS == 1 + 16 + 256
    # the largest per-slot state sizes vLLM's pages: linear attention's float32 moments
    assert VllmBased.get_mamba_state_shape_from_config(_fake_vllm_config(config)) == ((16, 273, 65),)
    assert VllmBased.get_mamba_state_dtype_from_config(_fake_vllm_config(config)) == (torch.float32,)
    assert VllmBased.get_mamba_state_shape_from_config(_fake_vllm_config(config, tp=2)) == ((8, 273, 65),)
    conv_only = _small_config(mixer_types=["conv", "sliding_attention", "conv", "conv"])
    shape = (256, 2) if is_conv_state_dim_first() else (2, 256)
    assert VllmBased.get_mamba_state_shape_from_config(_fake_vllm_config(conv_only)) == (shape,)
    assert VllmBased.get_mamba_state_dtype_from_config(_fake_vllm_config(conv_only)) == (torch.bfloat16,)
    with pytest.raises(ValueError, match="tensor parallel"):
        VllmBased.get_mamba_state_shape_from_config(_fake_vllm_config(config, tp=3))


def test_vllm_moment_packing_round_trips():
    _vllm()
    from tk_backend.vllm.based_model import pack_moments, unpack_moments

    state = reference.based_prefill_state(torch.randn(3, 7, 2, 16), torch.randn(3, 7, 2, 64))
    packed = pack_moments(state)
    assert packed.shape == (3, 2, 273, 65)
    for got, want in zip(unpack_moments(packed), state):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _reference_prefill(q, k, v, use_norm=True, *, initial_state=None, output_final_state=False):
    o, state = based_chunk_reference(q, k, v, initial_state, use_norm)
    return (o, state) if output_final_state else o


def _reference_step(q, k, v, state, use_norm=True, *, inplace=False):
    o, new = reference.based_step(q, k, v, state, use_norm=use_norm)
    if inplace:
        for dst, src in zip(state, new):
            dst.copy_(src)
        new = state
    return o.to(q.dtype), new


class _Proj(torch.nn.Module):
    """vLLM's linear layers return (output, bias)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out, bias=False)

    def forward(self, x):
        return self.lin(x), None


def _linear_layer(monkeypatch, based_model, hidden: int, heads: int, dv: int):
    """The vLLM linear-attention layer on the float32 references, with a 6-slot state cache full of NaN (stale
    slots: never read for new requests)."""
    monkeypatch.setattr(based, "parallel_based", _reference_prefill)
    monkeypatch.setattr(based, "based_step", _reference_step)
    torch.manual_seed(0)
    layer = based_model.BasedLinearAttention.__new__(based_model.BasedLinearAttention)
    torch.nn.Module.__init__(layer)
    layer.num_heads, layer.feature_dim, layer.head_dim, layer.use_norm, layer.prefix = heads, 16, dv, True, "l"
    layer.proj_q, layer.proj_k = _Proj(hidden, heads * 16), _Proj(hidden, heads * 16)
    layer.proj_v = _Proj(hidden, heads * dv)
    object.__setattr__(layer, "out_proj", lambda x: (x, None))
    cache = torch.full((6, heads, 273, dv + 1), float("nan"))
    layer.kv_cache = (cache,)
    return layer, cache


def test_vllm_linear_attention_padded_decode_rows_leave_the_null_block_alone(monkeypatch):
    """CUDA-graph padding rows (slot 0, vLLM's null block, or PAD_SLOT_ID -1) must not write a state into the
    null block: in a hybrid model that memory is also the null page other layers' caches point at."""
    _vllm()
    from tk_backend.vllm import based_model

    hidden, heads, dv = 32, 2, 64
    layer, cache = _linear_layer(monkeypatch, based_model, hidden, heads, dv)
    cache[0] = torch.randn_like(cache[0])  # whatever the null page holds (finite here, so a state would change it)
    cache[3] = 0.0  # a real request's slot after its prefill: zero moments
    null_before = cache[0].clone()
    md = SimpleNamespace(num_decodes=4, num_decode_tokens=4, num_prefills=0, num_prefill_tokens=0,
                         query_start_loc=torch.arange(5), seq_lens=torch.tensor([3, 0, 0, 0]),
                         state_indices_tensor=torch.tensor([3, 0, -1, 0], dtype=torch.int32))
    monkeypatch.setattr(based_model, "layer_metadata", lambda prefix: md)
    out = torch.empty(4, heads * dv)
    layer._forward(torch.randn(4, hidden), out, None)
    assert torch.equal(cache[0], null_before), "a padded decode row wrote into the null block"
    assert torch.isfinite(cache[3]).all() and cache[3].abs().sum() > 0, "the real request's state was not updated"


def test_vllm_linear_attention_slots_chunked_prefill_and_decode(monkeypatch):
    """Two requests through the vLLM layer's _forward: A prefilled in two chunks (the second from A's slot),
    B in one, then two decode steps of both; equal to the reference over each whole sequence."""
    _vllm()
    from tk_backend.vllm import based_model

    hidden, heads, dv = 32, 2, 64
    layer, cache = _linear_layer(monkeypatch, based_model, hidden, heads, dv)
    slot = {"A": 4, "B": 2}
    x = {"A": torch.randn(9, hidden), "B": torch.randn(5, hidden)}

    def step(batch, decodes):
        """batch: [(request, token slice, context length)], decodes first (vLLM's order)."""
        tokens = torch.cat([x[r][s] for r, s, _ in batch])
        lens = [s.stop - s.start for _, s, _ in batch]
        md = SimpleNamespace(
            num_decodes=decodes, num_decode_tokens=decodes, num_prefills=len(batch) - decodes,
            num_prefill_tokens=sum(lens[decodes:]),
            query_start_loc=torch.tensor([0] + lens).cumsum(0),
            seq_lens=torch.tensor([ctx + n for (_, _, ctx), n in zip(batch, lens)]),
            state_indices_tensor=torch.tensor([slot[r] for r, _, _ in batch], dtype=torch.int32))
        monkeypatch.setattr(based_model, "layer_metadata", lambda prefix: md)
        out = torch.empty(tokens.shape[0] + 3, heads * dv)  # padded like vLLM's buffers
        layer._forward(torch.cat([tokens, torch.zeros(3, hidden)]), out, None)
        return out[: tokens.shape[0]]

    a1 = step([("A", slice(0, 4), 0)], 0)
    b_and_a2 = step([("B", slice(0, 3), 0), ("A", slice(4, 7), 4)], 0)
    d1 = step([("A", slice(7, 8), 7), ("B", slice(3, 4), 3)], 2)
    d2 = step([("B", slice(4, 5), 4), ("A", slice(8, 9), 8)], 2)
    got = {"A": torch.cat([a1, b_and_a2[3:], d1[:1], d2[1:]]), "B": torch.cat([b_and_a2[:3], d1[1:], d2[:1]])}
    for r in ("A", "B"):
        q = layer.proj_q(x[r])[0].view(1, -1, heads, 16)
        k = layer.proj_k(x[r])[0].view(1, -1, heads, 16)
        v = layer.proj_v(x[r])[0].view(1, -1, heads, dv)
        torch.testing.assert_close(got[r], reference.based(q, k, v)[0].reshape(-1, heads * dv), rtol=1e-4, atol=1e-4)
