"""transformers' attn_implementation="tk" on CPU, with the float32 references standing in for the kernels.

Checks the plumbing, not the kernels: that "tk" is registered with a mask function, that tiny Llama / Mistral
models produce eager attention's logits through it (no padding, left and right padding, a KV cache during
generation, packed sequences, GQA, a sliding window), and which op each case goes through.
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


class _KernelStandIns:
    def __init__(self):
        self.calls: list[str] = []

    def dense(self, q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, out=None,
              return_softmax_lse=False):
        attention.validate_dense(*map(_meta_like, (q, k, v)), softmax_scale, causal, window_size, softcap, None)
        self.calls.append("dense")
        return reference.attention_dense(q, k, v, causal, softmax_scale, window_size, softcap)[0].to(q.dtype)

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, block_table=None, seqused_k=None, out=None,
               return_softmax_lse=False):
        attention.validate_varlen(*map(_meta_like, (q, k, v, cu_seqlens_q, cu_seqlens_k)), max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, window_size, softcap, None, None, None)
        assert int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) <= max_seqlen_q
        assert int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) <= max_seqlen_k
        self.calls.append("varlen")
        out, _ = reference.attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size,
                                     softcap)
        return out.to(q.dtype)


@pytest.fixture
def kernels(monkeypatch) -> _KernelStandIns:
    stand_ins = _KernelStandIns()
    monkeypatch.setattr(tk_hf, "flash_attn_func", stand_ins.dense)
    monkeypatch.setattr(tk_hf, "flash_attn_varlen_func", stand_ins.varlen)
    return stand_ins


def _model(kind: str = "llama", attn: str = "tk", **overrides):
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[kind]
    config = config_cls(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
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


def test_generate_with_left_padding_and_cache_matches_eager(kernels):
    tk, eager = _pair()
    ids = torch.randint(3, 300, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :11] = 0
    args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out_tk = tk.generate(ids, output_logits=True, return_dict_in_generate=True, **args)
        out_eager = eager.generate(ids, output_logits=True, return_dict_in_generate=True, **args)
    assert torch.equal(out_tk.sequences, out_eager.sequences)
    for a, b in zip(out_tk.logits, out_eager.logits):
        _close(a, b)
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


def test_refuses_sinks_and_training_dropout():
    module = torch.nn.Linear(2, 2)
    module.is_causal = True
    q = torch.randn(1, 4, 3, 64)
    k = torch.randn(1, 2, 3, 64)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        tk_hf.tk_attention_forward(module, q, k, k, None, s_aux=torch.zeros(4))
    module.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        tk_hf.tk_attention_forward(module, q, k, k, None, dropout=0.1)
    with pytest.raises(ValueError, match="2D padding mask"):
        tk_hf.tk_attention_forward(module.eval(), q, k, k, torch.zeros(1, 1, 3, 3))
