"""Pipeline parallelism: the decoder layers split into stages, each stage's ranks a process, over gloo on loopback,
on a tiny random Llama of 3 layers (an uneven split: 2 then 1) whose heads (4), KV heads (2) and MLP width divide by 2;
and a tiny Qwen3-MoE against Hugging Face."""

import families
import pytest
import torch
from test_gemma2 import gemma2_config
from test_qwen_moe import qwen3_moe
from test_tensor_parallel import make_engine, prompts, run

from conftest import assert_no_leaks, run_greedy
from engine.attention.selector import get_attn_backend
from engine.config import EngineArgs
from engine.distributed import parallel_state
from engine.models.files import load_config
from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_weights
from engine.models.utils import PPMissingLayer, get_pp_indices
from engine.request import Request, SamplingParams
from random_model import save_random_smollm2_shaped
from test_models import COMMON

LAYERS = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-pp")
    save_random_smollm2_shaped(path, **{**COMMON, "num_hidden_layers": LAYERS})
    return path


@pytest.fixture(scope="module")
def one_rank(tiny_model):
    """Greedy tokens, logprobs and prompt logprobs of one rank, with the longest prompt prefilled in chunks."""
    engine = make_engine(tiny_model, 1, max_num_batched_tokens=64)
    try:
        return run(engine)
    finally:
        engine.shutdown()


def count_batches_in_flight(engine) -> list[int]:
    """The batches in flight after each step the engine takes from now on (StepStats.num_batches_in_flight)."""
    in_flight = []
    step = engine.step

    def counted_step():
        outputs = step()
        in_flight.append(engine.last_step.num_batches_in_flight)
        return outputs

    engine.step = counted_step
    return in_flight


def assert_same(results, reference):
    """Each stage computes its layers as one rank does; the tensor-parallel ranks' partial sums add in another
    order, so logprobs agree to float rounding and the greedy tokens are identical."""
    for request_id, (tokens, logprobs, prompt_logprobs) in reference.items():
        pp_tokens, pp_logprobs, pp_prompt_logprobs = results[request_id]
        assert pp_tokens == tokens and len(tokens) == 12
        torch.testing.assert_close(torch.cat(pp_logprobs), torch.cat(logprobs), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pp_prompt_logprobs, prompt_logprobs, atol=1e-4, rtol=1e-4)


def test_two_by_two_ranks_give_one_ranks_output_with_batches_in_flight(tiny_model, one_rank):
    """TP x PP = 2 x 2 on 4 ranks. Three requests, the longest prefilled in two chunks: its second chunk goes into
    the pipeline while the first batch is still in it (a prompt's next tokens do not wait for its previous chunk's
    output)."""
    engine = make_engine(tiny_model, 2, pipeline_parallel_size=2, max_num_batched_tokens=64)
    in_flight = count_batches_in_flight(engine)
    try:
        # Rank 0 is the first stage: it holds and caches its layers (2 of 3) only, and computes no logits.
        model = engine.worker.model
        assert len(engine.worker.kv_caches) == 2 and isinstance(model.layers[2], PPMissingLayer)
        assert isinstance(model.lm_head, PPMissingLayer) and not isinstance(model.layers[1], PPMissingLayer)
        assert_same(run(engine), one_rank)
    finally:
        engine.shutdown()
    assert max(in_flight) == 2


def test_qwen3_moe_in_two_stages_matches_hugging_face(tmp_path):
    """PP = 2 on a mixture of experts (an even split, 1 and 1), prompts prefilled in chunks of 16 tokens, so that
    batches overlap in the pipeline."""
    config = qwen3_moe()
    path, hf_model = families.save_family_model(tmp_path, config)
    engine = families.make_engine(path, pipeline_parallel_size=2, max_num_batched_tokens=16, dtype="float32")
    in_flight = count_batches_in_flight(engine)
    try:
        batch = families.prompts(config)
        outputs = run_greedy(engine, batch, families.MAX_TOKENS)
        families.assert_matches_hf(hf_model, batch, outputs, "pipeline parallel 2")
        assert_no_leaks(engine)
    finally:
        engine.shutdown()
    assert max(in_flight) == 2


def test_a_one_rank_engine_beside_pipeline_stages_in_its_process_fails_instead_of_sampling_nothing(
    tiny_model, one_rank
):
    """Which stage the model runner is, it asks its process: beside a running PP = 2 engine a one-rank engine would
    send its activations to the other engine's stage and sample nothing, step after step (a driver waiting for its
    tokens spins forever). It fails with a message instead, and runs as before once the other engine is gone."""
    alone = make_engine(tiny_model, 1, max_num_batched_tokens=64)
    try:
        pipelined = make_engine(tiny_model, 1, pipeline_parallel_size=2)
        try:
            alone.add_request(Request("beside", prompts()[0], SamplingParams(temperature=0, max_tokens=2)))
            with pytest.raises(RuntimeError, match="pipeline stage 0 of 1, but its process is now stage 0 of 2"):
                alone.step()
            assert alone.fail_running_requests() == ["beside"]
        finally:
            pipelined.shutdown()
        assert_same(run(alone), one_rank)
    finally:
        alone.shutdown()


def test_layers_split_evenly_with_the_remainder_before_the_last_stage():
    assert [get_pp_indices(3, r, 2) for r in range(2)] == [(0, 2), (2, 3)]
    assert [get_pp_indices(10, r, 4) for r in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert [get_pp_indices(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def build_stage(model_cls, model_dir, monkeypatch, pp_rank: int, pp_size: int):
    """The model as stage pp_rank of pp_size builds and loads it."""
    monkeypatch.setattr(parallel_state, "_pp_rank", pp_rank)
    monkeypatch.setattr(parallel_state, "_pp_size", pp_size)
    model = model_cls(load_config(model_dir), get_attn_backend("torch", 16, "cpu"))
    model.load_weights(load_weights(model_dir))
    return model


def test_each_stage_builds_and_loads_only_its_part(tiny_model, tmp_path, monkeypatch):
    """The first stage has the embedding and no final norm or LM head, the last the reverse; each has its layers'
    weights, those of the whole model. The last stage's LM head is the tied embedding's tensor."""
    gemma_dir, _ = families.save_family_model(tmp_path, gemma2_config(num_hidden_layers=LAYERS))
    for model_cls, model_dir in ((LlamaForCausalLM, tiny_model), (Gemma2ForCausalLM, gemma_dir)):
        whole = dict(build_stage(model_cls, model_dir, monkeypatch, 0, 1).named_parameters())
        first, last = (build_stage(model_cls, model_dir, monkeypatch, r, 2) for r in range(2))
        assert isinstance(first.lm_head, PPMissingLayer) and isinstance(first.norm, PPMissingLayer)
        assert isinstance(last.embed_tokens, PPMissingLayer)
        assert [isinstance(layer, PPMissingLayer) for layer in first.layers] == [False, False, True]
        assert [isinstance(layer, PPMissingLayer) for layer in last.layers] == [True, True, False]
        names = set()
        for stage in (first, last):
            for name, param in stage.named_parameters():
                # The tied head has no name of its own in the whole model: it is the embedding.
                assert torch.equal(param, whole[name if name in whole else "embed_tokens.weight"]), name
                names.add(name)
        assert names - {"lm_head.weight"} == set(whole) and not any(
            n.startswith("layers.2") for n in dict(first.named_parameters())
        )


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"pipeline_parallel_size": 0}, r"pipeline_parallel_size must be in \[1, 64\], got 0"),
        ({"pipeline_parallel_size": 65}, r"pipeline_parallel_size must be in \[1, 64\], got 65"),
        ({"pipeline_parallel_size": 2, "enable_lora": True}, "--enable-lora is not implemented with --pipeline"),
        (
            {"pipeline_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            "--speculative-config is not implemented with --pipeline-parallel-size 2",
        ),
        ({"pipeline_parallel_size": 2, "sampler_address": "127.0.0.1:1"}, "--sampler-address is not implemented"),
    ],
)
def test_settings_that_do_not_combine_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**settings)


def test_more_stages_than_layers_are_refused_before_any_rank_starts(tiny_model):
    with pytest.raises(ValueError, match=r"3 decoder layers .* do not split into --pipeline-parallel-size 4 stages"):
        make_engine(tiny_model, 1, pipeline_parallel_size=4)
