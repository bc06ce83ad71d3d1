"""Out-of-tree models the plugin registers with vLLM (lazily: by "module:Class" path, nothing imported here).

vLLM reads a model directory's config.json with transformers' AutoConfig before it picks the architecture, so
the config classes of these models are registered with AutoConfig too (tk_backend.models.register_config, which
imports no model code). Both happen in every vLLM process, through the plugin's `register`.
"""
from __future__ import annotations

MODELS = {
    "BasedForCausalLM": "tk_backend.vllm.based_model:BasedForCausalLM",
}


def register_models() -> None:
    """Register MODELS with vLLM's ModelRegistry and their configs with AutoConfig (idempotent)."""
    from vllm import ModelRegistry

    from tk_backend.models import register_config

    register_config()
    supported = set(ModelRegistry.get_supported_archs())
    for architecture, path in MODELS.items():
        if architecture not in supported:
            ModelRegistry.register_model(architecture, path)


__all__ = ["MODELS", "register_models"]
