"""Nothing in a supported family's config is silently ignored: every field is read or reviewed as having no effect,
an unimplemented value is refused at start-up, and sliding-window layers attend as the model's do."""

import dataclasses

import pytest
import torch

from conftest import HFReference, assert_greedy_matches, assert_no_leaks, run_greedy
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.models.config import FAMILY_FIELDS, NO_EFFECT_FIELDS, USED_FIELDS, ModelArchConfig, ModelLoadError
from engine.models.registry import ModelRegistry
from test_models import COMMON

FAMILIES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Phi3ForCausalLM": "Phi3Config",
    "Gemma2ForCausalLM": "Gemma2Config",
    "Gemma3ForCausalLM": "Gemma3TextConfig",
    "MixtralForCausalLM": "MixtralConfig",
    "Qwen2MoeForCausalLM": "Qwen2MoeConfig",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
    "DeepseekV2ForCausalLM": "DeepseekV2Config",
    "DeepseekV3ForCausalLM": "DeepseekV3Config",
    "GptOssForCausalLM": "GptOssConfig",
    "LlavaForConditionalGeneration": "LlavaConfig",
    "Qwen2VLForConditionalGeneration": "Qwen2VLConfig",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLConfig",
    "Gemma3ForConditionalGeneration": "Gemma3Config",
}


def hf_config(arch: str, **extra):
    import transformers

    return getattr(transformers, FAMILIES[arch])(**{**COMMON, **extra})


def test_every_supported_architecture_has_its_config_class_walked():
    assert sorted(FAMILIES) == ModelRegistry.get_supported_archs()


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_config_field_is_used_or_reviewed(arch):
    import transformers

    cls = getattr(transformers, FAMILIES[arch])
    fields = {f.name for f in dataclasses.fields(cls)} | set(cls().to_dict())
    unreviewed = fields - USED_FIELDS - FAMILY_FIELDS.get(arch, frozenset()) - NO_EFFECT_FIELDS
    assert not unreviewed, (
        f"{cls.__name__} has fields the engine neither reads nor lists as having no effect: {sorted(unreviewed)}"
    )


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("hidden_act", "gelu", "gelu"),
        ("mlp_bias", True, "True"),
        ("layer_types", ["full_attention", "chunked_attention"], "chunked_attention"),
        ("rope_scaling", {"rope_type": "proportional", "factor": 4.0}, "proportional"),
        ("partial_rotary_factor", 0.5, "0.5"),
    ],
)
def test_an_unimplemented_value_is_refused_naming_the_field_and_value(field, value, shown):
    d = {**hf_config("LlamaForCausalLM").to_dict(), "architectures": ["LlamaForCausalLM"], field: value}
    d.pop("rope_parameters", None)
    with pytest.raises(ModelLoadError, match=field) as refused:
        ModelArchConfig.from_hf_config(d)
    assert shown in str(refused.value)


@pytest.mark.parametrize(
    "arch, extra, window",
    [
        ("MistralForCausalLM", dict(sliding_window=32), 32),
        ("MistralForCausalLM", dict(sliding_window=None), None),
        ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1), 32),
        # Qwen2's window only where use_sliding_window is on, and only on the layers from max_window_layers on.
        ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=32), None),
        ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=32, max_window_layers=2), None),
        ("LlamaForCausalLM", dict(), None),
        # Qwen3 as Qwen2; Phi-3 as Mistral: every layer where a window is set.
        ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=32, max_window_layers=1), 32),
        ("Qwen3ForCausalLM", dict(use_sliding_window=False, sliding_window=32), None),
        ("Phi3ForCausalLM", dict(sliding_window=32), 32),
    ],
)
def test_sliding_window_is_read_as_transformers_reads_it(arch, extra, window):
    config = hf_config(arch, **extra)
    d = {**config.to_dict(), "architectures": [arch]}
    assert ModelArchConfig.from_hf_config(d).sliding_window == window
    # Qwen2's older configs carry no layer_types: max_window_layers says which layers slide.
    d.pop("layer_types", None)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and extra["use_sliding_window"]:
        d["sliding_window"] = 32  # transformers drops it from the dict where no layer slides
    assert ModelArchConfig.from_hf_config(d).sliding_window == window


def save_sliding_model(tmp_path, arch, **extra):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch, **extra), dtype=torch.float32).eval()
    path = tmp_path / arch
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("MistralForCausalLM", dict(sliding_window=16)),
        # Qwen2: full attention on layer 0, a window on layer 1.
        ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_sliding_window_attention_past_the_window_is_the_models(tmp_path, arch, extra, backend):
    """Prompt and output run well past the window, through chunked prefill and prefix-cache hits, and the engine
    still matches the model: each sliding layer sees only the last `sliding_window` keys."""
    path, hf_model = save_sliding_model(tmp_path, arch, **extra)
    engine = EngineCore(
        EngineArgs(
            model=str(path), kv_cache_memory="8MiB", block_size=8, attention_backend=backend, max_num_batched_tokens=24
        )
    )
    assert engine.max_model_len == COMMON["max_position_embeddings"]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (40, 7)]
    prompts.append(prompts[0][:32] + prompts[1])  # a prefix-cache hit past the window
    for prompt, ours in zip(prompts, run_greedy(engine, prompts, 20)):
        ref_tokens, ref_logits = HFReference(hf_model).greedy(prompt, 20)
        assert_greedy_matches(ours, ref_tokens, ref_logits, f"{arch} past its window")
    assert_no_leaks(engine)


@pytest.mark.parametrize("name", ["auto", "torch", "cpu"])
def test_an_attention_backend_lacking_a_feature_the_model_needs_is_refused_by_name(name):
    from engine.attention.selector import get_attn_backend

    for needs in ({"sliding_window"}, {"logits_soft_cap"}):
        assert get_attn_backend(name, 8, "cpu", frozenset(needs)) is not None
    with pytest.raises(ValueError, match="does not implement chunked_local_attention"):
        get_attn_backend(name, 8, "cpu", frozenset({"sliding_window", "chunked_local_attention"}))


def test_qwen2_without_use_sliding_window_is_full_attention(tmp_path):
    path, _ = save_sliding_model(tmp_path, "Qwen2ForCausalLM", use_sliding_window=False, sliding_window=32)
    engine = EngineCore(EngineArgs(model=str(path), kv_cache_memory="8MiB", block_size=8))
    assert engine.model_config.sliding_window is None and not engine.model_config.layer_types


# transformers' DeepseekV2Config leaves num_experts_per_tok unset (None), so its defaults describe no runnable model;
# nor do Gemma3Config's: its default SigLIP tower has 14 patches a side, which 256 tokens an image (16 a side) cannot
# pool (transformers' pooling kernel is 0).
NOT_A_MODEL_BY_DEFAULT = {"DeepseekV2ForCausalLM", "Gemma3ForConditionalGeneration"}


@pytest.mark.parametrize("arch", sorted(set(FAMILIES) - NOT_A_MODEL_BY_DEFAULT))
def test_the_checkpoint_each_config_class_describes_is_accepted(arch):
    """A transformers config class's defaults describe a released checkpoint (its docstring names it; docs/models.md
    lists them): the engine reads that configuration without refusing any of it."""
    import transformers

    d = {**getattr(transformers, FAMILIES[arch])().to_dict(), "architectures": [arch]}
    config = ModelArchConfig.from_hf_config(d)
    # A vision-language config holds its language model's in text_config.
    assert config.architecture == arch and config.num_hidden_layers == d.get("text_config", d)["num_hidden_layers"]
