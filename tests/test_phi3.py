"""Phi-3 against Hugging Face on tiny random models: fused qkv_proj and gate_up_proj checkpoints (split per rank under
tensor parallelism), a sliding window on every layer, and LongRoPE below, across and above
original_max_position_embeddings (past it transformers recomputes the whole sequence with the long factors, and so
does the engine); then the engine's paths that touch the model (tests/families.py)."""

import json

import families
import pytest
import torch

from conftest import assert_no_leaks
from engine.models.config import ModelArchConfig, ModelLoadError
from test_models import COMMON

# Past this length transformers switches to the long factors (max_position_embeddings is COMMON's 256).
ORIGINAL_LEN = 64
HALF_HEAD = COMMON["hidden_size"] // COMMON["num_attention_heads"] // 2
_gen = torch.Generator().manual_seed(3)
LONGROPE = dict(
    rope_type="longrope",
    rope_theta=10000.0,
    short_factor=(1 + torch.rand(HALF_HEAD, generator=_gen) * 0.5).tolist(),
    long_factor=(2 + torch.rand(HALF_HEAD, generator=_gen) * 6).tolist(),
)
VARIANTS = {
    "plain": dict(),
    "window": dict(sliding_window=16),
    # The attention factor from max_position_embeddings / original_max_position_embeddings, as Phi-3 configs have it.
    "longrope": dict(rope_parameters=LONGROPE, original_max_position_embeddings=ORIGINAL_LEN),
    "window-longrope": dict(sliding_window=16, rope_parameters=LONGROPE, original_max_position_embeddings=ORIGINAL_LEN),
    "longrope-factor": dict(
        rope_parameters={**LONGROPE, "attention_factor": 1.3}, original_max_position_embeddings=ORIGINAL_LEN
    ),
}


def config(variant="plain"):
    import transformers

    return transformers.Phi3Config(**{**COMMON, "pad_token_id": 0, **VARIANTS[variant]})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf_with_chunked_prefill_and_prefix_hits(tmp_path, variant):
    families.check_greedy_chunked_and_prefix_cached(tmp_path, config(variant))


def test_preemption_structured_output_speculation_tp_lora_and_kv_store(tmp_path, redis_server):
    # PEFT targets Phi-3's fused qkv_proj and gate_up_proj by those names (one A, one B over the fused output).
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    families.check_engine_paths(tmp_path, config("longrope"), redis_server.url, targets)


def test_old_rope_type_names_are_longrope_and_partial_rotary_is_refused():
    d = {**config("longrope").to_dict(), "architectures": ["Phi3ForCausalLM"]}
    rope = d.pop("rope_parameters")
    for old in ("su", "yarn"):
        old_style = {**d, "rope_scaling": {**rope, "type": old, "rope_type": None}}
        del old_style["rope_scaling"]["rope_type"]
        scaling = ModelArchConfig.from_hf_config(old_style).rope_scaling
        assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIGINAL_LEN
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor=0\.75"):
        ModelArchConfig.from_hf_config({**d, "rope_parameters": {**rope, "partial_rotary_factor": 0.75}})


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"speculative_config": json.dumps(NGRAM)}, {"tensor_parallel_size": 2}],
    ids=["plain", "ngram", "tp2"],
)
def test_longrope_below_across_and_above_the_original_length(tmp_path, engine_kwargs):
    """Short factors while a request fits in the original length, long ones from the first token for a longer prompt,
    and a request whose output grows past it recomputed whole with the long factors at that step, as transformers
    does: greedy output identical, prefilled in chunks with the prefix cache on (with n-gram drafts, none verified
    past the switch with the short factors; with two ranks, each offsetting its requests' positions)."""
    path, hf_model = families.save_family_model(tmp_path, config("window-longrope"))
    engine = families.make_engine(path, max_num_batched_tokens=16, **engine_kwargs)
    try:
        assert engine.max_model_len == config().max_position_embeddings
        # Up to (40 + 24), across (the 56-token prompt's output passes 64 at its 9th token, the last 40-token one's
        # at its 25th, drafts proposed before it), above (90 from the start).
        batch = families.prompts(config(), (40, 56, ORIGINAL_LEN, 90))
        batch.append(batch[0])
        verified = _record_short_rope_verifications(engine)
        outputs = families.run_greedy(engine, batch, [24, 24, 24, 24, 32])
        families.assert_matches_hf(hf_model, batch, outputs, "below, across, above")
        if "speculative_config" in engine_kwargs:  # drafts verified up to the switch, never past it
            assert max(verified) == ORIGINAL_LEN, verified
        assert engine.scheduler.num_preemptions == 0  # the switches are not counted as preemptions
        assert_no_leaks(engine)
    finally:
        engine.shutdown()


def _record_short_rope_verifications(engine) -> list[int]:
    """Where each scheduled chunk with drafts of a request not longer than the original length ends (its tokens plus
    the drafts it verifies), step by step."""
    ends, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        output = schedule()
        for r in output.scheduled_requests:
            if r.num_tokens <= ORIGINAL_LEN and output.scheduled_spec_decode_tokens.get(r.request_id):
                ends.append(r.num_computed_tokens + output.num_scheduled_tokens[r.request_id])
        return output

    engine.scheduler.schedule = recording_schedule
    return ends


def test_long_and_short_factor_blocks_never_share_the_prefix_cache(tmp_path):
    """The same tokens rotated with the short and with the long factors are different KV: a long request never hits
    a short one's blocks, nor a short one a long one's; requests of one kind share theirs."""
    path, hf_model = families.save_family_model(tmp_path, config("longrope"))
    engine = families.make_engine(path)
    base, other = families.prompts(config(), (96, 96))

    def run(prompt, max_tokens=4):
        """The prefix-cache hits of a request of this prompt, and its output."""
        hits = engine.get_stats().prefix_cache_hits
        ours = families.run_greedy(engine, [prompt], max_tokens)
        families.assert_matches_hf(hf_model, [prompt], ours, f"{len(prompt)} tokens")
        return engine.get_stats().prefix_cache_hits - hits, ours[0]

    assert run(base[:48])[0] == 0  # short: 6 blocks cached with the short factors
    assert run(base[:80])[0] == 0  # long: the same first 48 tokens, but no hit
    assert run(base[:88])[0] == 80  # long: the blocks of the one before
    assert run(base[:50])[0] == 48  # short: the short blocks, not the long ones
    # A request that grows past the original length (60 + 8 tokens) leaves 8 short blocks, then its recompute 8
    # long ones: each kind of request hits its own.
    hits, output = run(other[:60], 8)
    grown = other[:60] + output
    assert hits == 0
    assert run(grown + other[:8])[0] == 64
    assert run(grown[:64])[0] == 56
    assert_no_leaks(engine)


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_on_the_fused_projections_matches_peft_merged(tmp_path, tp):
    """An adapter on the fused qkv_proj and gate_up_proj alone gives the PEFT-merged model's output; with two ranks
    each takes its rows of q, k and v, and of gate and up, from the fused B."""
    families.check_lora(tmp_path, config("window"), ["qkv_proj", "gate_up_proj"], tensor_parallel_size=tp)


def test_lora_on_a_projection_alone_and_fused_is_refused(tmp_path):
    """An adapter with q_proj's matrices and qkv_proj's both would add two deltas to q: refused, naming them."""
    from safetensors.torch import save_file

    from engine.lora.peft import load_peft_adapter
    from engine.lora.request import LoRARequest

    cfg = ModelArchConfig.from_hf_config({**config().to_dict(), "architectures": ["Phi3ForCausalLM"]})
    rank, q = 4, cfg.num_attention_heads * cfg.head_dim
    qkv = q + 2 * cfg.num_key_value_heads * cfg.head_dim
    prefix = "base_model.model.model.layers.0.self_attn"
    tensors = {
        f"{prefix}.qkv_proj.lora_A.weight": torch.randn(rank, cfg.hidden_size),
        f"{prefix}.qkv_proj.lora_B.weight": torch.randn(qkv, rank),
        f"{prefix}.q_proj.lora_A.weight": torch.randn(rank, cfg.hidden_size),
        f"{prefix}.q_proj.lora_B.weight": torch.randn(q, rank),
    }
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["qkv_proj", "q_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(adapter_config))
    with pytest.raises(ValueError, match="layer 0's q_proj is adapted twice"):
        load_peft_adapter(LoRARequest("both", 1, str(tmp_path)), cfg, rank)
