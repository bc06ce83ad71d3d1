"""Model definitions served through tk_backend's ops: Based (arXiv 2402.18668) for transformers.

    import tk_backend.models
    tk_backend.models.register()   # AutoConfig "based" -> BasedConfig, AutoModelForCausalLM -> BasedForCausalLM
    model = AutoModelForCausalLM.from_pretrained(local_dir, dtype=torch.bfloat16)

The vLLM side (tk_backend.vllm.based_model) is registered by the vLLM plugin.
"""
from __future__ import annotations

from tk_backend.models.configuration_based import BasedConfig


def register() -> None:
    """Register Based with transformers' Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from tk_backend.models.modeling_based import BasedForCausalLM, BasedModel

    for auto, name, cls in ((AutoConfig, BasedConfig.model_type, BasedConfig),
                            (AutoModel, BasedConfig, BasedModel),
                            (AutoModelForCausalLM, BasedConfig, BasedForCausalLM)):
        try:
            auto.register(name, cls, exist_ok=True)
        except TypeError:  # transformers releases without exist_ok
            try:
                auto.register(name, cls)
            except ValueError:
                pass


def register_config() -> None:
    """Only AutoConfig "based" (what vLLM's processes need to read config.json; imports no model code)."""
    from transformers import AutoConfig

    AutoConfig.register(BasedConfig.model_type, BasedConfig, exist_ok=True)


__all__ = ["BasedConfig", "register", "register_config"]
