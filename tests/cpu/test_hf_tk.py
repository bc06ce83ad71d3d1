"""transformers' attn_implementation="tk" on CPU, with the float32 references standing in for the kernels.

Checks the plumbing, not the kernels: that "tk" is registered with a mask function, that tiny Llama / Mistral /
gpt-oss models produce eager attention's logits through it (no padding, left and right padding, a KV cache during
generation, packed sequences, GQA, a sliding window, attention sinks), and which op each case goes through.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import tk_backend.hf as tk_hf  # noqa: E402
from tk_backend import attention, reference  # noqa: E402


def _meta_like(t: torch.Tensor | None) -> torch.Tensor | None:
    """Same shape and strides on the meta device; float tensors as bf16, what the real ops take."""
    if t is None:
        return None
    dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")


def _check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """What the real ops check of sinks (float32 [q heads] on q's device, head dims 64/128/256)."""
    if sinks is not None:
        attention.validate_sinks(torch.empty_strided(sinks.shape, sinks.stride(), dtype=sinks.dtype, device="meta"),
                                 _meta_like(q))


def _uniform_cu_seqlens(batch: int, length: int) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32)


class _KernelStandIns:
    def __init__(self):
        self.calls: list[str] = []
        self.sinks: list[torch.Tensor | None] = []  # each call's

    def dense(self, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, out=None,
              return_softmax_lse=False, sinks=None):
        attention.validate_dense(*map(_meta_like, (q, k, v)), softmax_scale, causal, window_size, softcap, None)
        _check_sinks(sinks, q)
        self.calls.append("dense")
        self.sinks.append(sinks)
        (bsz, nq, hq, d), nk = q.shape, k.shape[1]
        out, _ = reference.attention(q.reshape(bsz * nq, hq, d), k.reshape(bsz * nk, -1, d),
                                     v.reshape(bsz * nk, -1, d), _uniform_cu_seqlens(bsz, nq),
                                     _uniform_cu_seqlens(bsz, nk), softmax_scale, causal, window_size, softcap,
                                     sinks=sinks)
        return out.view(bsz, nq, hq, d).to(q.dtype)

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, block_table=None, seqused_k=None, out=None,
               return_softmax_lse=False, sinks=None):
        attention.validate_varlen(*map(_meta_like, (q, k, v, cu_seqlens_q, cu_seqlens_k)), max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, window_size, softcap, None, None, None)
        _check_sinks(sinks, q)
        assert int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
        assert int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) <= max_seqlen_k
        self.calls.append("varlen")
        self.sinks.append(sinks)
        out, _ = reference.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size,
                                     softcap, sinks=sinks)
        return out.to(q.dtype)


@pytest.fixture
def kernels(monkeypatch) -> _KernelStandIns:
    stand_ins = _KernelStandIns()
    monkeypatch.setattr(tk_hf, "flash_attn_func", stand_ins.dense)
    monkeypatch.setattr(tk_hf, "flash_attn_varlen_func", stand_ins.varlen)
    return stand_ins


def _model(kind: str = "llama", attn: str = "tk", **overrides):
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "gpt_oss": transformers.GptOssConfig}[kind]
    if kind == "gpt_oss":  # gpt-oss-20b's attention (head dim 64, GQA, alternating windows, sinks), a tiny MoE
        overrides = dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                         rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=1.0,
                                              original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0),
                         **overrides)
    config = config_cls(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    if kind == "gpt_oss":  # sinks of trained gpt-oss's magnitude, not the initializer's ~0
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model.eval()


def _pair(kind: str = "llama", **overrides):
    tk = _model(kind, "tk", **overrides)
    eager = _model(kind, "eager", **overrides)
    eager.load_state_dict(tk.state_dict())
    return tk, eager


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), f"max |diff| {float((a - b).abs().max()):.3e}"


def test_tk_is_registered_with_a_mask_function():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    tk_hf.register()
    assert AttentionInterface()["tk"] is tk_hf.tk_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["tk"] is flash_attention_mask
    assert _model().config._attn_implementation == "tk"


def test_from_pretrained_selects_tk(tmp_path, kernels):
    _model(attn="eager").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="tk")
    assert model.config._attn_implementation == "tk"
    model(torch.randint(0, 300, (1, 9)))
    assert kernels.calls == ["dense", "dense"]  # one per layer


def test_unpadded_batch_matches_eager(kernels):
    tk, eager = _pair()
    ids = torch.randint(0, 300, (3, 17))
    with torch.no_grad():
        _close(tk(ids).logits, eager(ids).logits)
    assert set(kernels.calls) == {"dense"}


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_eager_on_real_tokens(kernels, side):
    tk, eager = _pair()
    lens = [17, 9, 1, 13]
    ids = torch.randint(0, 300, (4, 17))
    mask = torch.zeros(4, 17, dtype=torch.long)
    for b, n in enumerate(lens):
        if side == "left":
            mask[b, 17 - n:] = 1
        else:
            mask[b, :n] = 1
    with torch.no_grad():
        got, want = tk(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    real = mask.bool()
    _close(got[real], want[real])
    assert set(kernels.calls) == {"varlen"}


def _generate_matches_eager(tk, eager, left_padding: list[int], length: int, max_new_tokens: int) -> None:
    """Greedy generation with a KV cache from left-padded prompts: the same tokens and logits at every step."""
    ids = torch.randint(3, 300, (len(left_padding), length))
    mask = torch.ones(len(left_padding), length, dtype=torch.long)
    for row, pad in enumerate(left_padding):
        mask[row, :pad] = 0
    args = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                eos_token_id=None)
    with torch.no_grad():
        out_tk = tk.generate(ids, output_logits=True, return_dict_in_generate=True, **args)
        out_eager = eager.generate(ids, output_logits=True, return_dict_in_generate=True, **args)
    assert torch.equal(out_tk.sequences, out_eager.sequences)
    for a, b in zip(out_tk.logits, out_eager.logits):
        _close(a, b)


def test_generate_with_left_padding_and_cache_matches_eager(kernels):
    _generate_matches_eager(*_pair(), left_padding=[0, 5, 11], length=12, max_new_tokens=6)
    assert "varlen" in kernels.calls  # the padded prefill and the decode steps that see padded keys


def test_packed_sequences_attend_only_within_their_sequence(kernels):
    tk, eager = _pair()
    lens = [7, 11, 4]
    seqs = [torch.randint(0, 300, (1, n)) for n in lens]
    packed = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        got = tk(packed, position_ids=position_ids).logits[0]
        want = torch.cat([eager(s).logits[0] for s in seqs])
    _close(got, want)
    assert set(kernels.calls) == {"varlen"}


def test_sliding_window_matches_eager(kernels):
    tk, eager = _pair("mistral", sliding_window=6)
    ids = torch.randint(0, 300, (2, 21))
    mask = torch.ones(2, 21, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        _close(tk(ids[:1]).logits, eager(ids[:1]).logits)
        real = mask.bool()
        _close(tk(ids, attention_mask=mask).logits[real], eager(ids, attention_mask=mask).logits[real])


@pytest.mark.parametrize("padded", [False, True])
def test_gpt_oss_attention_sinks_match_eager(kernels, padded):
    tk, eager = _pair("gpt_oss")
    ids = torch.randint(0, 300, (2, 15))
    mask = torch.ones(2, 15, dtype=torch.long)
    if padded:
        mask[1, :6] = 0
    with torch.no_grad():
        got, want = tk(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
    _close(got[mask.bool()], want[mask.bool()])
    assert kernels.calls == (["varlen"] if padded else ["dense"]) * 2
    for sinks, layer in zip(kernels.sinks, tk.model.layers):
        assert sinks.dtype == torch.float32 and torch.equal(sinks, layer.self_attn.sinks.float())


def test_gpt_oss_generate_with_sinks_and_a_cache_matches_eager(kernels):
    _generate_matches_eager(*_pair("gpt_oss"), left_padding=[0, 3], length=10, max_new_tokens=5)
    assert kernels.sinks and all(s is not None for s in kernels.sinks)


def test_s_aux_reaches_the_ops_as_float32_sinks(kernels):
    """transformers passes the module's sinks parameter (its dtype, e.g. bf16) as s_aux; the ops take float32."""
    module = torch.nn.Linear(2, 2)
    module.is_causal = True
    q, k = torch.randn(1, 4, 3, 64), torch.randn(1, 2, 3, 64)
    s_aux = torch.randn(4).to(torch.bfloat16)
    tk_hf.tk_attention_forward(module, q, k, k, None, s_aux=s_aux)
    tk_hf.tk_attention_forward(module, q, k, k, torch.ones(1, 3, dtype=torch.long), s_aux=s_aux)
    assert kernels.calls == ["dense", "varlen"]
    for sinks in kernels.sinks:
        assert sinks.dtype == torch.float32 and torch.equal(sinks, s_aux.float())
    tk_hf.tk_attention_forward(module, q, k, k, None)
    assert kernels.sinks[-1] is None


def test_sinks_at_a_head_dim_the_kernels_lack_are_refused_by_the_op(kernels):
    module = torch.nn.Linear(2, 2)
    module.is_causal = True
    q, k = torch.randn(1, 4, 3, 96), torch.randn(1, 2, 3, 96)
    with pytest.raises(ValueError, match="attention sinks need head dim 64, 128 or 256, got 96"):
        tk_hf.tk_attention_forward(module, q, k, k, None, s_aux=torch.zeros(4))


def test_refuses_training_dropout():
    module = torch.nn.Linear(2, 2)
    module.is_causal = True
    q = torch.randn(1, 4, 3, 64)
    k = torch.randn(1, 2, 3, 64)
    module.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        tk_hf.tk_attention_forward(module, q, k, k, None, dropout=0.1)
    with pytest.raises(ValueError, match="2D padding mask"):
        tk_hf.tk_attention_forward(module.eval(), q, k, k, torch.zeros(1, 1, 3, 3))
