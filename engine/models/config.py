"""The few model hyper-parameters the engine needs, read from a Hugging Face config.json dict."""

from dataclasses import dataclass

from engine.models.registry import ModelRegistry

# Older or hand-written configs may lack "architectures" but name a model_type.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


class ModelLoadError(ValueError):
    """A model could not be found, read or used; the message names the file or the problem."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable, but its architecture is not one the engine implements."""


@dataclass
class ModelArchConfig:
    """The checkpoint's architecture (vLLM's hf_config); the settings the engine runs it with are
    engine.config.ModelConfig."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None
    # The checkpoint's own quantization (config.json's quantization_config.quant_method): "gguf" for a converted GGUF.
    quantization: str | None = None

    @classmethod
    def from_hf_config(cls, d: dict) -> "ModelArchConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""), d.get("model_type"))
        if not ModelRegistry.is_supported(arch):
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r}; supported: {', '.join(ModelRegistry.get_supported_archs())}"
            )

        def need(key):
            if d.get(key) is None:
                raise ModelLoadError(f"config for {arch} is missing required key {key!r}")
            return d[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        # transformers >= 5 writes rope settings as one "rope_parameters" dict instead of rope_theta/rope_scaling.
        rope_params = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        rope_params.pop("rope_theta", None)
        rope_scaling = d.get("rope_scaling") or rope_params or None
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            # Old configs say "type"; the engine reads "rope_type".
            rope_scaling.setdefault("rope_type", rope_scaling.pop("type", "default"))
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None

        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else [int(x) for x in (eos if isinstance(eos, list) else [eos])]

        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its config has no flag for it); Llama may opt in.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            quantization=(d.get("quantization_config") or {}).get("quant_method"),
        )
