"""transformers with attn_implementation="tk" on an H200: logits against "sdpa" (both bf16) and float32 eager.

Random-weight Llama / Mistral models with head dims 64, 128 and 256, GQA and MQA, a sliding window; unpadded
and left-padded batches, and the first decoding steps with a KV cache. TK's error against the float32 model
must be no worse than sdpa's (within a margin for bf16 rounding), and TK must agree with sdpa directly.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import tk_backend.hf  # noqa: E402,F401  (registers "tk")

CASES = {
    "llama-hd64-gqa4": ("llama", dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64)),
    "llama-hd128-gqa2": ("llama", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
                                       head_dim=128)),
    "llama-hd256-mqa": ("llama", dict(hidden_size=2048, num_attention_heads=8, num_key_value_heads=1, head_dim=256)),
    "mistral-hd128-window": ("mistral", dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
                                             head_dim=128, sliding_window=96)),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=sorted(CASES))
def models(request):
    kind, shape = CASES[request.param]
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[kind]
    config = config_cls(vocab_size=4096, intermediate_size=2 * shape["hidden_size"], num_hidden_layers=3,
                        max_position_embeddings=4096, **shape)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                              dtype=torch.float32).cuda().eval()
    built = {"fp32": reference}
    for attn in ("tk", "sdpa"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.bfloat16)
        model.load_state_dict(reference.state_dict())
        built[attn] = model.cuda().eval()
    return built


def _check(models, ids, mask=None, what=""):
    with torch.no_grad():
        logits = {name: m(ids, attention_mask=mask).logits for name, m in models.items()}
    keep = mask.bool() if mask is not None else torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    tk, sdpa, ref = (logits[n][keep] for n in ("tk", "sdpa", "fp32"))
    assert not torch.isnan(tk).any(), f"{what}: NaN logits"
    err_tk, err_sdpa = _rel(tk, ref), _rel(sdpa, ref)
    assert err_tk <= 1.5 * err_sdpa + 2e-3, f"{what}: error vs fp32 tk {err_tk:.2e} sdpa {err_sdpa:.2e}"
    assert _rel(tk, sdpa) < 3e-2, f"{what}: tk vs sdpa {_rel(tk, sdpa):.2e}"
    top1 = (tk.argmax(-1) == sdpa.argmax(-1)).float().mean().item()
    assert top1 > 0.95, f"{what}: top-1 agreement with sdpa {top1:.3f}"


def test_unpadded_batch(models):
    ids = torch.randint(8, 4096, (3, 333), device="cuda")
    _check(models, ids, what="unpadded")


def test_left_padded_batch(models):
    lens = [333, 200, 1, 77]
    ids = torch.randint(8, 4096, (4, 333), device="cuda")
    mask = torch.zeros(4, 333, dtype=torch.long, device="cuda")
    for b, n in enumerate(lens):
        mask[b, 333 - n:] = 1
    _check(models, ids, mask, what="left padded")


def test_decoding_with_cache(models):
    ids = torch.randint(8, 4096, (3, 150), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    args = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        tk = models["tk"].generate(ids, **args)
        sdpa = models["sdpa"].generate(ids, **args)
    # Steps after a disagreement decode different tokens; compare the steps up to the first one.
    for step, (a, b) in enumerate(zip(tk.logits, sdpa.logits)):
        assert _rel(a, b) < 3e-2, f"decode step {step}: tk vs sdpa {_rel(a, b):.2e}"
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            break
