"""vLLM's ModelRegistry: each Hugging Face `architectures` name maps to the module under engine/models/ and the class
that implements it. Modules are imported on first use, so reading a config
imports no model code."""

import importlib

# architecture -> (module in engine/models/, class). One file a family; a variant that differs only in its config
# fields shares its family's class.
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
}


class ModelRegistry:
    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(_MODELS)

    @staticmethod
    def is_supported(architecture: str) -> bool:
        return architecture in _MODELS

    @staticmethod
    def resolve_model_cls(architecture: str) -> type:
        """The model class for an architecture the config check already accepted."""
        if architecture not in _MODELS:
            raise ValueError(
                f"unsupported model architecture {architecture!r}; "
                f"supported: {', '.join(ModelRegistry.get_supported_archs())}"
            )
        module, cls = _MODELS[architecture]
        return getattr(importlib.import_module(f"engine.models.{module}"), cls)
