"""The few model hyper-parameters the engine needs, read from a Hugging Face config.json dict.

Nothing is silently ignored: every field of the supported families' Hugging Face config classes is either read here
(USED_FIELDS), by its family's model file (FAMILY_FIELDS), or on the reviewed list of fields with no effect on the output (NO_EFFECT_FIELDS), and a value the
engine does not implement is refused at start-up with a message naming the field (tests/test_model_config.py walks
the classes).
"""

from dataclasses import dataclass, field, replace

from engine.models.registry import ModelRegistry

# Older or hand-written configs may lack "architectures" but name a model_type.
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llava": "LlavaForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}

# Base models without an LM head, as embedding checkpoints (Qwen3-Embedding...) are saved: each runs as its family's
# causal LM with --runner pooling, its LM head tied to the embeddings and never used.
EMBEDDING_ARCHS = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}

# The rope types layers.get_rope implements.
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")

# Rope types that stretch the original context: the length they stretch (original_max_position_embeddings) is
# max_position_embeddings where a config does not say.
_ROPE_TYPES_WITH_ORIGINAL_LEN = ("llama3", "yarn", "longrope")

# The config.json fields from_hf_config reads.
USED_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "mlp_bias",
        "attention_bias",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "max_position_embeddings",
        "tie_word_embeddings",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
        "dtype",
        "quantization_config",
    }
)

# Fields only some families read, by architecture: their model file reads them from ModelArchConfig.hf_config.
_GEMMA2_FIELDS = frozenset(
    {
        "hidden_activation",  # Gemma names its MLP activation so; transformers does not read hidden_act there
        "query_pre_attn_scalar",  # the attention scale is query_pre_attn_scalar ** -0.5
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "use_bidirectional_attention",  # refused when set: the engine's attention is causal
    }
)
# The mixture-of-experts families' routing and expert sizes (engine/models/fused_moe.py).
_QWEN_MOE_FIELDS = frozenset(
    {
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",  # whether the chosen experts' weights are renormalised to sum to 1
        "decoder_sparse_step",  # every decoder_sparse_step-th layer has experts...
        "mlp_only_layers",  # ...but these, which keep a dense MLP of intermediate_size
    }
)
# DeepSeek-V2's multi-head latent attention and its routed and shared experts (engine/models/deepseek_v2.py).
_DEEPSEEK_V2_FIELDS = frozenset(
    {
        "kv_lora_rank",  # the latent each token keeps in the KV cache
        "q_lora_rank",  # None: q_proj; else q_a_proj, its norm and q_b_proj
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "qk_head_dim",  # their sum, which transformers writes beside them
        "v_head_dim",
        "first_k_dense_replace",  # the first layers keep a dense MLP; the others have experts
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_shared_experts",  # one dense MLP of n_shared_experts * moe_intermediate_size every token passes through
        "routed_scaling_factor",
        "topk_method",  # greedy, or group_limited_greedy over n_group groups of which topk_group are kept
        "n_group",
        "topk_group",
        "norm_topk_prob",  # refused when set: transformers' DeepSeek-V2 does not renormalise
    }
)
# DeepSeek-V3: V2's attention and experts, routed by sigmoid scores over groups always (no topk_method).
_DEEPSEEK_V3_FIELDS = (_DEEPSEEK_V2_FIELDS - {"topk_method"}) | {
    "rope_interleave",  # RoPE on interleaved pairs (True) or rotate-half
    # The multi-token-prediction layers (transformers' name and the checkpoint's): greedy decoding does not run them,
    # and their weights, past num_hidden_layers, are skipped as transformers skips them.
    "num_mtp_layers",
    "num_nextn_predict_layers",
}
# LLaVA: its vision tower's and language model's own configs (each checked in _llava_config), and how the image
# features are chosen, projected and placed.
_LLAVA_FIELDS = frozenset(
    {
        "vision_config",
        "text_config",
        "image_token_index",
        "image_seq_length",  # the processor's count of placeholders an image; the vision tower's shape decides it
        "projector_hidden_act",
        "vision_feature_select_strategy",
        "vision_feature_layer",
        "multimodal_projector_bias",
    }
)
# Qwen2-VL and Qwen2.5-VL: the vision tower's and language model's configs (checked in _qwen2_vl_config), and the
# special tokens around and inside an image's placeholders (only image_token_id decides anything).
_QWEN2_VL_FIELDS = frozenset(
    {"vision_config", "text_config", "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"}
)
FAMILY_FIELDS: dict[str, frozenset[str]] = {
    "LlavaForConditionalGeneration": _LLAVA_FIELDS,
    "Qwen2VLForConditionalGeneration": _QWEN2_VL_FIELDS,
    "Qwen2_5_VLForConditionalGeneration": _QWEN2_VL_FIELDS,
    # boi/eoi: the tokens the processor wraps an image's placeholders in, ordinary tokens to the model.
    "Gemma3ForConditionalGeneration": frozenset(
        {
            "text_config",
            "vision_config",
            "mm_tokens_per_image",
            "image_token_index",
            "boi_token_index",
            "eoi_token_index",
        }
    ),  # fmt: skip
    # Phi-3 keeps LongRoPE's pretraining length outside its rope parameters (from_hf_config moves it in).
    "Phi3ForCausalLM": frozenset({"original_max_position_embeddings"}),
    "Gemma2ForCausalLM": _GEMMA2_FIELDS,
    # rope_local_base_freq: the sliding layers' rope base in configs older than the per-layer-type rope_parameters;
    # sliding_window_pattern: one full layer in that many where a config has no layer_types.
    # attn_logit_softcapping: transformers' Gemma 3 attention never applies it, and neither does the engine's.
    "Gemma3ForCausalLM": _GEMMA2_FIELDS | {"rope_local_base_freq", "sliding_window_pattern"},
    "MixtralForCausalLM": frozenset({"num_local_experts", "num_experts_per_tok"}),
    # qkv_bias: Qwen2-MoE's q/k/v biases (read as attention_bias); its shared expert has a width of its own.
    "Qwen2MoeForCausalLM": _QWEN_MOE_FIELDS | {"shared_expert_intermediate_size", "qkv_bias"},
    # transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts.
    "Qwen3MoeForCausalLM": _QWEN_MOE_FIELDS | {"num_local_experts"},
    "DeepseekV2ForCausalLM": _DEEPSEEK_V2_FIELDS,
    "DeepseekV3ForCausalLM": _DEEPSEEK_V3_FIELDS,
    # gpt-oss's experts (engine/models/gpt_oss.py): their number, a token's, and their clamped SwiGLU's gain and clamp.
    "GptOssForCausalLM": frozenset({"num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"}),
}

# The vision-language families: a vision encoder feeding a language model of one of the text families.
MULTIMODAL_ARCHS = (
    "LlavaForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)
# The Qwen2-VL families' vision configs: the fields each tower reads (engine/models/qwen2_vl.py), and those with no
# effect on an image's embeddings.
_QWEN2_VL_VISION_FIELDS = frozenset(
    {
        "depth", "embed_dim", "hidden_size", "hidden_act", "mlp_ratio", "num_heads", "in_channels", "patch_size",
        "spatial_merge_size", "temporal_patch_size", "rope_parameters", "model_type", "initializer_range",
    }
)  # fmt: skip
_QWEN2_5_VL_VISION_FIELDS = (_QWEN2_VL_VISION_FIELDS - {"embed_dim", "mlp_ratio"}) | {
    "intermediate_size",
    "out_hidden_size",
    "window_size",
    "fullatt_block_indexes",
    "tokens_per_second",  # videos' temporal positions only
}
# The language models LLaVA's model file builds (engine/models/llava.py).
_LLAVA_TEXT_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# A vision tower's config fields by its model_type (engine/models/vision.py's towers): read there, or with no effect
# on the image features.
_VISION_FIELDS = frozenset(
    {
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels", "image_size",
        "patch_size", "hidden_act", "layer_norm_eps", "model_type", "attention_dropout", "dropout",
        "initializer_range", "initializer_factor",
    }
)  # fmt: skip
VISION_CONFIG_FIELDS = {
    "clip_vision_model": _VISION_FIELDS | {"projection_dim"},  # CLIP's contrastive projection: unused
    "siglip_vision_model": _VISION_FIELDS | {"vision_use_head"},  # its pooling head: its output is never read
}
# The language models that run with attention both ways within each image's placeholders (Gemma 3's prefix-LM
# mask): the scheduler never splits an image across prefill chunks, and the attention backend unmasks the span.
MM_PREFIX_LM_ARCHS = ("Gemma3ForConditionalGeneration",)

# The families with multi-head latent attention (engine/attention/mla.py).
MLA_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")

# The mixture-of-experts families (engine/models/fused_moe.py).
MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")

# The families whose attention has sinks (a learned logit a head in the softmax's denominator).
ATTENTION_SINKS = ("GptOssForCausalLM",)

# The families whose attention applies attn_logit_softcapping.
SOFT_CAPPED_ATTENTION = ("Gemma2ForCausalLM",)

# transformers' defaults for the family fields a config.json may leave out; ModelArchConfig.hf_config has them.
_GEMMA_DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256}
FAMILY_DEFAULTS: dict[str, dict] = {
    "Gemma2ForCausalLM": {**_GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": _GEMMA_DEFAULTS,
    "MixtralForCausalLM": {"num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
    # transformers' DeepseekV2Config defaults (q_lora_rank's among them: a config.json may leave it out).
    "DeepseekV2ForCausalLM": {
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "first_k_dense_replace": 0,
        "n_routed_experts": 64,
        "num_experts_per_tok": None,
        "moe_intermediate_size": 1407,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
        "norm_topk_prob": False,
    },
    "DeepseekV3ForCausalLM": {
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "rope_interleave": True,
    },
    # transformers' GptOssConfig defaults, for every field it reads (a config.json may leave any out); its
    # layer_types default, sliding on the even layers, is _sliding_window's.
    "GptOssForCausalLM": {
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "head_dim": 64,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "rope_parameters": {
            "rope_theta": 150000.0,
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
    "Qwen3MoeForCausalLM": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
}

# transformers' default_theta, where a family's is not 10000.
_DEFAULT_ROPE_THETA = {"GptOssForCausalLM": 150000.0}

# The MLP activations (hidden_act) each family implements; silu where a family is not listed.
HIDDEN_ACTS: dict[str, tuple[str, ...]] = {
    "Gemma2ForCausalLM": ("gelu_pytorch_tanh",),
    "Gemma3ForCausalLM": ("gelu_pytorch_tanh",),
}

# The field a family names its activation in, where it is not hidden_act.
HIDDEN_ACT_FIELD = {"Gemma2ForCausalLM": "hidden_activation", "Gemma3ForCausalLM": "hidden_activation"}

# Reviewed: fields that do not change what the model computes at inference. Adding one here is a claim about the
# output; a field that does change it belongs in from_hf_config, read or refused.
NO_EFFECT_FIELDS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "use_cache",  # Hugging Face's own KV cache; the engine has its paged one
        "initializer_range",  # random initialisation, before the checkpoint's weights are loaded
        "attention_dropout",  # training only
        "pretraining_tp",  # transformers no longer reads it (it once split matmuls to mimic pretraining rounding)
        "pad_token_id",  # batches are flat, never padded
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "chunk_size_feed_forward",  # memory only: the same result a chunk at a time
        "is_encoder_decoder",  # False for these decoder-only classes
        "id2label",  # sequence-classification heads
        "label2id",
        "problem_type",
        "resid_pdrop",  # Phi-3's dropouts: training only
        "embd_pdrop",
        # transformers' record of Gemma 3's sliding_window_pattern; layer_types, written beside it, says which
        # layers slide, and transformers does not read it back.
        "_sliding_window_pattern",
        # The mixture-of-experts routers' training terms: the load-balancing loss, its weight, and Mixtral's
        # multiplicative noise on the router's input (applied in training mode only).
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
    }
)


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
    # The window of the model's sliding-window layers (a query attends to the last sliding_window tokens there);
    # None when every layer attends to the whole context.
    sliding_window: int | None = None
    # Each layer's attention, "full_attention" or "sliding_attention" (empty: every layer full).
    layer_types: tuple[str, ...] = ()
    # Multi-head latent attention (MLA_ARCHS): the width of the latent each token keeps in place of K and V
    # (kv_lora_rank) and of the rotary key beside it (qk_rope_head_dim); None in the other families.
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    # The whole config.json, for the fields only some families read (FAMILY_FIELDS).
    hf_config: dict = field(default_factory=dict, repr=False)
    # The checkpoint's own architecture where it is a base model without an LM head (EMBEDDING_ARCHS); None else.
    embedding_architecture: str | None = None

    @property
    def has_lm_head(self) -> bool:
        return self.embedding_architecture is None

    def attention_features(self) -> frozenset[str]:
        """What the layers ask of the attention backend beyond causal attention (AttentionBackend.features)."""
        features = {"sliding_window"} if self.sliding_window is not None else set()
        if self.kv_lora_rank is not None:
            features.add("mla")
        if self.architecture in SOFT_CAPPED_ATTENTION and self.hf_config.get("attn_logit_softcapping"):
            features.add("logits_soft_cap")
        if self.architecture in ATTENTION_SINKS:
            features.add("sinks")
        if self.is_mm_prefix_lm:
            features.add("mm_prefix")
        return frozenset(features)

    @property
    def is_mm_prefix_lm(self) -> bool:
        """Whether the language model attends both ways within each image's placeholders (vLLM's name)."""
        return self.architecture in MM_PREFIX_LM_ARCHS

    def layer_sliding_window(self, layer: int) -> int | None:
        """The window layer `layer` attends in; None: the whole context."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == "sliding_attention" else None

    def rope_switch_len(self) -> int | None:
        """The length past which a sequence is rotated with other frequencies from its first token on (LongRoPE's
        long factors past original_max_position_embeddings); None where the rope never switches."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type") != "longrope":
            return None
        original = scaling["original_max_position_embeddings"]
        return original if self.max_position_embeddings > original else None

    @classmethod
    def from_hf_config(cls, d: dict) -> "ModelArchConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""), d.get("model_type"))
        embedding_arch = arch if arch in EMBEDDING_ARCHS else None
        if embedding_arch is not None:
            # No lm_head.weight to load: the head shares the embeddings' (and is never run).
            arch, d = EMBEDDING_ARCHS[arch], {**d, "tie_word_embeddings": True}
        if not ModelRegistry.is_supported(arch):
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r}; supported: {', '.join(ModelRegistry.get_supported_archs())}"
            )

        if arch == "Gemma3ForConditionalGeneration":
            return _gemma3_mm_config(cls, d, arch)
        if arch == "LlavaForConditionalGeneration":
            return _llava_config(cls, d, arch)
        if arch in MULTIMODAL_ARCHS:
            return _qwen2_vl_config(cls, d, arch)
        if arch == "GptOssForCausalLM":
            # Its defaults differ from the other families' in fields read below (window, biases, rope, eps).
            d = {**FAMILY_DEFAULTS[arch], **d}

        def need(key):
            if d.get(key) is None:
                raise ModelLoadError(f"config for {arch} is missing required key {key!r}")
            return d[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        layers = int(need("num_hidden_layers"))
        # transformers >= 5 writes rope settings as one "rope_parameters" dict instead of rope_theta/rope_scaling.
        rope_params = dict(d.get("rope_parameters") or {})
        # Gemma 3 has one rope a layer type: the model's is the full layers'; its model file reads the sliding ones'.
        rope_params = dict(rope_params.get("full_attention", rope_params))
        rope_theta = d.get("rope_theta") or rope_params.get("rope_theta") or _DEFAULT_ROPE_THETA.get(arch, 10000.0)
        rope_params.pop("rope_theta", None)
        rope_scaling = d.get("rope_scaling") or rope_params or None
        if rope_scaling is not None:
            rope_scaling = _rope_scaling(d, arch, dict(rope_scaling))
            if rope_scaling["rope_type"] not in ROPE_TYPES:
                raise ModelLoadError(
                    f"rope_scaling type {rope_scaling['rope_type']!r} is not implemented; "
                    f"supported: {', '.join(ROPE_TYPES)}"
                )
            if rope_scaling["rope_type"] == "default":
                rope_scaling = None
        max_position = int(d.get("max_position_embeddings", 2048))
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            # The attention factor is the one of the full context (transformers' default factor).
            rope_scaling.setdefault("factor", max_position / rope_scaling["original_max_position_embeddings"])
        _refuse_unimplemented(d, arch)
        window, layer_types = _sliding_window(d, arch, layers)

        family = {**FAMILY_DEFAULTS.get(arch, {}), **d}
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else [int(x) for x in (eos if isinstance(eos, list) else [eos])]

        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            # MLA's rope turns qk_rope_head_dim dims (transformers sets head_dim so).
            head_dim=int(family["qk_rope_head_dim"] if arch in MLA_ARCHS else d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(d, arch),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            quantization=(d.get("quantization_config") or {}).get("quant_method"),
            sliding_window=window,
            layer_types=layer_types,
            kv_lora_rank=int(family["kv_lora_rank"]) if arch in MLA_ARCHS else None,
            qk_rope_head_dim=int(family["qk_rope_head_dim"]) if arch in MLA_ARCHS else None,
            hf_config=family,
            embedding_architecture=embedding_arch,
        )


def _llava_config(cls, d: dict, arch: str) -> "ModelArchConfig":
    """LLaVA: its language model's config, under LLaVA's architecture, with the whole config.json (the vision
    tower's and projector's settings) as hf_config; what the engine does not implement is refused by name."""
    text = dict(d.get("text_config") or {})
    text_arch = (text.get("architectures") or [_MODEL_TYPE_TO_ARCH.get(text.get("model_type", "llama"))])[0]
    if text_arch not in _LLAVA_TEXT_ARCHS:
        raise ModelLoadError(f"text_config architecture {text_arch!r} is not implemented for LLaVA; supported: "
                             f"{', '.join(_LLAVA_TEXT_ARCHS)}")  # fmt: skip
    vision = _vision_config(d, "clip_vision_model", ("clip_vision_model", "siglip_vision_model"))
    checks = [
        ("projector_hidden_act", d.get("projector_hidden_act", "gelu"), ("gelu",)),
        ("vision_feature_select_strategy", d.get("vision_feature_select_strategy", "default"), ("default", "full")),
    ]
    for name, value, allowed in checks:
        if value not in allowed:
            raise ModelLoadError(f"{name}={value!r} is not implemented; supported: {', '.join(allowed)}")
    layer = d.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ModelLoadError(f"vision_feature_layer={layer!r} is not implemented; one layer (an integer) is")
    text_cfg = cls.from_hf_config({**text, "architectures": [text_arch]})
    image_token = d.get("image_token_index", d.get("image_token_id", 32000))
    family = {**d, "vision_config": vision, "image_token_index": image_token, "vision_feature_layer": layer,
              "text_architecture": text_arch}  # fmt: skip
    return replace(text_cfg, architecture=arch, hf_config=family)


def _qwen2_vl_config(cls, d: dict, arch: str) -> "ModelArchConfig":
    """Qwen2-VL and Qwen2.5-VL: the Qwen2 language model's config (transformers 5 nests it in text_config; 4 writes
    it beside vision_config) under the family's architecture, with M-RoPE's sections and the vision tower's config
    in hf_config; what the engine does not implement is refused by name."""
    text = dict(d.get("text_config") or {k: v for k, v in d.items() if k not in _QWEN2_VL_FIELDS})
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or d.get("rope_scaling") or {})
    section = rope.pop("mrope_section", [16, 24, 24])  # transformers' default
    if rope.get("rope_type", rope.get("type")) == "mrope":  # transformers 4's name for M-RoPE over the default rope
        rope.pop("type", None)
        rope["rope_type"] = "default"
    if section is None or len(section) != 3:
        raise ModelLoadError(f"rope mrope_section={section!r} is not implemented; three sections are")
    text.pop("rope_scaling", None)
    text["rope_parameters"] = rope
    vision = dict(d.get("vision_config") or {})
    qwen2_5 = arch == "Qwen2_5_VLForConditionalGeneration"
    fields = _QWEN2_5_VL_VISION_FIELDS if qwen2_5 else _QWEN2_VL_VISION_FIELDS
    unknown = sorted(set(vision) - fields - USED_FIELDS - NO_EFFECT_FIELDS)
    if unknown:
        raise ModelLoadError(f"vision_config fields {unknown} are not implemented")
    vision_rope = (vision.get("rope_parameters") or {}).get("rope_type", "axial")
    if vision_rope not in ("axial", "default"):
        raise ModelLoadError(f"vision_config rope_type {vision_rope!r} is not implemented; supported: axial")
    act = vision.get("hidden_act", "silu" if qwen2_5 else "quick_gelu")
    if act not in ("quick_gelu", "gelu", "silu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"vision_config.hidden_act={act!r} is not implemented")
    defaults = {"in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    vision = {**defaults, "hidden_act": act, **vision}
    text_cfg = cls.from_hf_config({**text, "architectures": ["Qwen2ForCausalLM"]})
    if 2 * sum(section) != text_cfg.head_dim:
        raise ModelLoadError(
            f"rope mrope_section={section!r} is not implemented for head_dim {text_cfg.head_dim}: the sections must "
            "cover half the head"
        )
    family = {
        **d,
        "image_token_id": int(d.get("image_token_id", 151655)),
        "vision_config": vision,
        "mrope_section": list(section),
        "qwen2_5": qwen2_5,
    }
    # A text config nested in transformers 5's layout may leave tie_word_embeddings at the top level.
    tie = bool(text.get("tie_word_embeddings", d.get("tie_word_embeddings", False)))
    return replace(text_cfg, architecture=arch, hf_config=family, tie_word_embeddings=tie)


def _vision_config(d: dict, default_type: str, types: tuple[str, ...]) -> dict:
    """The vision tower's config (its model_type filled in), what the towers do not implement refused by name."""
    vision = dict(d.get("vision_config") or {})
    vision.setdefault("model_type", default_type)
    if vision["model_type"] not in types:
        raise ModelLoadError(f"vision_config model_type {vision['model_type']!r} is not implemented; supported: "
                             f"{', '.join(types)}")  # fmt: skip
    unknown = sorted(set(vision) - VISION_CONFIG_FIELDS[vision["model_type"]] - USED_FIELDS - NO_EFFECT_FIELDS)
    if unknown:
        raise ModelLoadError(f"vision_config fields {unknown} are not implemented")
    acts = ("quick_gelu", "gelu", "gelu_pytorch_tanh")  # engine.models.vision.VISION_ACTIVATIONS
    if vision.get("hidden_act", "gelu_pytorch_tanh") not in acts:
        raise ModelLoadError(f"vision_config.hidden_act={vision['hidden_act']!r} is not implemented; supported: "
                             f"{', '.join(acts)}")  # fmt: skip
    for name in ("image_size", "patch_size"):
        if name in vision and not isinstance(vision[name], int):
            raise ModelLoadError(
                f"vision_config.{name}={vision[name]!r} is not implemented; square images (an integer)"
            )
    return vision


def _gemma3_mm_config(cls, d: dict, arch: str) -> "ModelArchConfig":
    """Gemma 3 with its vision tower: its text model's config (Gemma3ForCausalLM's checks) under this architecture,
    with the tower's and projector's settings added to hf_config."""
    text = {**(d.get("text_config") or {}), "architectures": ["Gemma3ForCausalLM"]}
    text_cfg = cls.from_hf_config(text)
    vision = _vision_config(d, "siglip_vision_model", ("siglip_vision_model",))
    tokens = int(d.get("mm_tokens_per_image", 256))
    side, patches = round(tokens**0.5), vision.get("image_size", 224) // vision.get("patch_size", 16)
    if side * side != tokens or patches % side:
        raise ModelLoadError(f"mm_tokens_per_image={tokens} is not implemented; it must be a square whose side "
                             f"divides the tower's {patches} patches a side")  # fmt: skip
    family = {**text_cfg.hf_config, "vision_config": vision, "mm_tokens_per_image": tokens,
              "image_token_index": int(d.get("image_token_index", 262_144))}  # fmt: skip
    tie = bool(d.get("tie_word_embeddings", True))
    return replace(text_cfg, architecture=arch, hf_config=family, tie_word_embeddings=tie)


def _attention_bias(d: dict, arch: str) -> bool:
    """Qwen2 always has q/k/v biases (its config has no flag for it), Qwen2-MoE where qkv_bias says (by default);
    the others where attention_bias does."""
    if arch == "Qwen2ForCausalLM":
        return True
    if arch == "Qwen2MoeForCausalLM":
        return bool(d.get("qkv_bias", True))
    return bool(d.get("attention_bias", False))


def _rope_scaling(d: dict, arch: str, rope_scaling: dict) -> dict:
    """The rope parameters as transformers standardizes them: "rope_type" (old configs say "type"; Phi-3's "su" and
    "yarn" are its LongRoPE), and the original context length where the type stretches one."""
    rope_type = rope_scaling.pop("type", None)
    rope_scaling.setdefault("rope_type", rope_type or "default")
    if arch == "Phi3ForCausalLM" and rope_scaling["rope_type"] in ("su", "yarn"):
        rope_scaling["rope_type"] = "longrope"
    rope_scaling.pop("partial_rotary_factor", None)  # _refuse_unimplemented checks it is 1
    if rope_scaling["rope_type"] in _ROPE_TYPES_WITH_ORIGINAL_LEN:
        # Phi-3's own field wins over the one in its rope parameters, as in transformers.
        original = d.get("original_max_position_embeddings") if arch == "Phi3ForCausalLM" else None
        original = original or rope_scaling.get("original_max_position_embeddings")
        rope_scaling["original_max_position_embeddings"] = int(original or d.get("max_position_embeddings", 2048))
    return rope_scaling


def _refuse_unimplemented(d: dict, arch: str) -> None:
    """A start-up error for a config value that changes the computation in a way the engine does not implement."""
    acts, act_field = HIDDEN_ACTS.get(arch, ("silu",)), HIDDEN_ACT_FIELD.get(arch, "hidden_act")
    if d.get(act_field, acts[0]) not in acts:
        raise ModelLoadError(f"{act_field}={d[act_field]!r} is not implemented; the MLP supports {', '.join(acts)}")
    if d.get("use_bidirectional_attention"):
        raise ModelLoadError(
            f"use_bidirectional_attention={d['use_bidirectional_attention']!r} is not implemented; attention is causal"
        )
    local_rope = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local_rope.get("rope_type", "default") != "default":
        raise ModelLoadError(
            f"rope_parameters.sliding_attention rope_type {local_rope['rope_type']!r} is not implemented; "
            "the sliding layers' rope is the default one"
        )
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor={partial!r} is not implemented; RoPE turns the whole head")
    if d.get("mlp_bias"):
        raise ModelLoadError(f"mlp_bias={d['mlp_bias']!r} is not implemented; the MLP has no biases")
    if arch in MOE_ARCHS:
        _refuse_unimplemented_moe({**FAMILY_DEFAULTS[arch], **d}, arch)
    if arch in MLA_ARCHS:
        _refuse_unimplemented_deepseek({**FAMILY_DEFAULTS[arch], **d}, arch)
    unknown = set(d.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ModelLoadError(
            f"layer_types holds {sorted(unknown)}, not implemented; supported: full_attention, sliding_attention"
        )


def _refuse_unimplemented_moe(d: dict, arch: str) -> None:
    """A mixture-of-experts config the layer cannot route as transformers does."""
    experts = d.get("num_local_experts", d.get("num_experts")) if arch != "Qwen2MoeForCausalLM" else d["num_experts"]
    top_k = d["num_experts_per_tok"]
    if experts and not 1 <= top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok={top_k!r} is not implemented; it must be 1 to the {experts} experts")
    step = d.get("decoder_sparse_step", 1)
    if arch != "MixtralForCausalLM" and (not isinstance(step, int) or step < 1):
        raise ModelLoadError(f"decoder_sparse_step={step!r} is not implemented; it must be a positive integer")


def _refuse_unimplemented_deepseek(d: dict, arch: str) -> None:
    """A DeepSeek config the engine cannot compute as transformers does."""
    heads, kv_heads = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if kv_heads != heads:
        raise ModelLoadError(
            f"num_key_value_heads={kv_heads!r} is not implemented for {arch}; multi-head latent attention makes "
            f"every head's K and V from one latent (num_key_value_heads = num_attention_heads = {heads})"
        )
    if arch == "DeepseekV3ForCausalLM":
        _refuse_unimplemented_deepseek_v3_routing(d)
        return
    if d.get("norm_topk_prob"):
        raise ModelLoadError(
            f"norm_topk_prob={d['norm_topk_prob']!r} is not implemented for {arch}: transformers' DeepSeek-V2 never "
            "renormalises the chosen experts' weights"
        )
    method = d.get("topk_method")
    if method not in ("greedy", "group_limited_greedy"):
        raise ModelLoadError(
            f"topk_method={method!r} is not implemented for {arch}; supported: greedy, group_limited_greedy"
        )
    experts, top_k = d["n_routed_experts"], d["num_experts_per_tok"]
    layers = d["num_hidden_layers"]
    if d["first_k_dense_replace"] < layers and not (isinstance(top_k, int) and 1 <= top_k <= experts):
        raise ModelLoadError(f"num_experts_per_tok={top_k!r} is not implemented; it must be 1 to the {experts} experts")
    if method == "group_limited_greedy":
        groups, kept = d.get("n_group"), d.get("topk_group")
        if not groups or experts % groups or not kept or not 1 <= kept <= groups:
            raise ModelLoadError(
                f"n_group={groups!r} with topk_group={kept!r} is not implemented; group_limited_greedy needs n_group "
                f"dividing the {experts} experts and topk_group from 1 to n_group"
            )
    # Fields of DeepSeek's own config.json (its remote code) that transformers' class lacks.
    if d.get("scoring_func", "softmax") != "softmax":
        raise ModelLoadError(f"scoring_func={d['scoring_func']!r} is not implemented for {arch}; supported: softmax")
    if d.get("moe_layer_freq", 1) != 1:
        raise ModelLoadError(
            f"moe_layer_freq={d['moe_layer_freq']!r} is not implemented; every layer from first_k_dense_replace on "
            "has experts"
        )


def _refuse_unimplemented_deepseek_v3_routing(d: dict) -> None:
    """DeepSeek-V3's router: sigmoid scores, groups scored by their two best experts (so at least two a group)."""
    experts, top_k, groups, kept = d["n_routed_experts"], d["num_experts_per_tok"], d["n_group"], d["topk_group"]
    if not groups or experts % groups or experts // groups < 2 or not kept or not 1 <= kept <= groups:
        raise ModelLoadError(
            f"n_group={groups!r} with topk_group={kept!r} is not implemented; the router needs n_group dividing the "
            f"{experts} experts into groups of at least 2 and topk_group from 1 to n_group"
        )
    if d["first_k_dense_replace"] < d["num_hidden_layers"] and not (
        isinstance(top_k, int) and 1 <= top_k <= kept * experts // groups
    ):
        raise ModelLoadError(
            f"num_experts_per_tok={top_k!r} is not implemented; it must be 1 to the experts of topk_group groups"
        )
    # Fields of DeepSeek's own config.json (its remote code) that transformers' class lacks.
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        raise ModelLoadError(
            f"scoring_func={d['scoring_func']!r} is not implemented for DeepSeek-V3; supported: sigmoid"
        )
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ModelLoadError(
            f"topk_method={d['topk_method']!r} is not implemented for DeepSeek-V3; supported: noaux_tc"
        )
    if d.get("moe_layer_freq", 1) != 1:
        raise ModelLoadError(
            f"moe_layer_freq={d['moe_layer_freq']!r} is not implemented; every layer from first_k_dense_replace on "
            "has experts"
        )


def _sliding_window(d: dict, arch: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """The window of the model's sliding-window layers and each layer's type, as transformers reads them: a config's
    layer_types where it has them; else every layer slides when there is a window (Mistral, Phi-3), but Qwen2 and Qwen3
    slide only with use_sliding_window, and then on the layers from max_window_layers on; Gemma in a fixed pattern."""
    window = d.get("sliding_window")
    qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
    gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    alternating = gemma or arch == "GptOssForCausalLM"
    if gemma and not window:  # transformers cannot run these without one either
        raise ModelLoadError(f"sliding_window={window!r} is not implemented; Gemma's sliding layers need a window")
    if not window or (qwen and not d.get("use_sliding_window")):
        return None, ()
    layer_types = d.get("layer_types")
    if layer_types is None and alternating:
        # Every pattern-th layer is full, the others slide (Gemma 2 and gpt-oss alternate; Gemma 3 has a pattern of 6).
        pattern = int(d.get("sliding_window_pattern", 6)) if arch == "Gemma3ForCausalLM" else 2
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if layer_types is None and arch == "Qwen2MoeForCausalLM":
        # Qwen2-MoE's own pattern: every other layer slides, from the first, below max_window_layers.
        below = int(d.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i % 2 == 0 and i < below else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        # Qwen3-MoE slides on every layer, as Mistral and Phi-3 do (it has no max_window_layers).
        first = int(d.get("max_window_layers", num_layers)) if qwen and arch != "Qwen3MoeForCausalLM" else 0
        layer_types = ["full_attention"] * first + ["sliding_attention"] * (num_layers - first)
    if len(layer_types) != num_layers:
        raise ModelLoadError(
            f"layer_types has {len(layer_types)} entries; the model has num_hidden_layers={num_layers}"
        )
    if "sliding_attention" not in layer_types:
        return None, ()
    return int(window), tuple(layer_types)
