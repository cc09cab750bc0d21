"""Embedding models with --runner pooling, against Hugging Face on tiny random base models (no LM head): Qwen3Model
with last-token pooling and normalisation (Qwen3-Embedding's sentence-transformers config), LlamaModel with mean
pooling, each through chunked prefill and a second pass over a warm prefix cache; the pooler config's sources and
what a pooling or a generating engine refuses."""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_no_leaks
from engine import LLM, SamplingParams
from engine.pooling import PoolingParams
from random_model import save_word_level_tokenizer
from test_models import COMMON

BLOCK = 8
LENGTHS = (5, 19, 45, 8)  # 45 runs in three chunks of --max-num-batched-tokens 16; 8 is one full block
ATOL = 2e-5


def save_base_model(path, config, pooling_mode: str | None = None, normalize: bool = False, seed: int = 0):
    """A transformers base model (AutoModel: no LM head) with random weights, its 1-D ones too, saved with a word
    tokenizer, and with sentence-transformers' modules.json and 1_Pooling/config.json when pooling_mode is given
    (e.g. "lasttoken"), plus a Normalize module when normalize. Returns the model (float32, eval)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.copy_(torch.randn_like(param) * 0.3 + (0.0 if name.endswith("bias") else 1.0))
    model.save_pretrained(path)
    save_word_level_tokenizer(path, config.vocab_size)
    if pooling_mode is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append(
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
            )
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
        st = {f"pooling_mode_{m}": m == pooling_mode for m in modes}
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": config.hidden_size, **st, "include_prompt": True})
        )
    return model


def hf_hidden_states(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0]


def prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


def make_llm(path, **kwargs) -> LLM:
    return LLM(str(path), kv_cache_memory="8MiB", block_size=BLOCK, max_num_batched_tokens=16, **kwargs)


def embed(llm: LLM, prompt_list, params=None) -> list:
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompt_list], params, use_tqdm=False)
    assert_no_leaks(llm.engine)
    return outputs


def assert_close(outputs, expected: list[torch.Tensor]) -> None:
    assert len(outputs) == len(expected)
    for out, want in zip(outputs, expected):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3-Embedding's shape in small: Qwen3Model, last-token pooling, normalised."""
    import transformers

    path = tmp_path_factory.mktemp("qwen3-embedding")
    config = transformers.Qwen3Config(**{**COMMON, "head_dim": 32}, architectures=["Qwen3Model"])
    return path, save_base_model(path, config, "lasttoken", normalize=True), config


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """LlamaModel with mean pooling, not normalised."""
    import transformers

    path = tmp_path_factory.mktemp("llama-embedding")
    config = transformers.LlamaConfig(**COMMON, architectures=["LlamaModel"])
    return path, save_base_model(path, config, "mean_tokens"), config


def test_qwen3_last_token_normalised_matches_hf_chunked_and_prefix_cached(qwen3):
    path, hf, config = qwen3
    llm = make_llm(path)  # --runner auto: a base model without an LM head is a pooling model
    assert llm.engine.runner_type == "pooling" and llm.engine.info.architecture == "Qwen3Model"
    prompt_list = prompts(config.vocab_size)
    expected = [F.normalize(hf_hidden_states(hf, p)[-1], dim=-1) for p in prompt_list]
    first = embed(llm, prompt_list)
    assert_close(first, expected)
    assert all(abs(torch.tensor(o.outputs.embedding).norm().item() - 1) < 1e-5 for o in first)
    assert [o.prompt_token_ids for o in first] == prompt_list
    # Again, over the blocks the first pass cached: last-token pooling reads the prefix cache.
    again = embed(llm, prompt_list)
    assert_close(again, expected)
    assert [o.num_cached_tokens for o in again] == [(n - 1) // BLOCK * BLOCK for n in LENGTHS]
    assert again[2].num_cached_tokens > 0
    # normalize=False per request: the raw last hidden state.
    raw = embed(llm, prompt_list[:2], PoolingParams(normalize=False))
    assert_close(raw, [hf_hidden_states(hf, p)[-1] for p in prompt_list[:2]])


def test_llama_mean_pooling_matches_hf_chunked_and_skips_prefix_hits(llama):
    path, hf, config = llama
    llm = make_llm(path, runner="pooling")
    prompt_list = prompts(config.vocab_size)
    expected = [hf_hidden_states(hf, p).mean(dim=0) for p in prompt_list]
    assert_close(embed(llm, prompt_list), expected)
    # A mean needs every position computed: the second pass takes no prefix-cache hits, and agrees.
    again = embed(llm, prompt_list)
    assert_close(again, expected)
    assert [o.num_cached_tokens for o in again] == [0] * len(LENGTHS)


def test_pooler_config_flag_overrides_the_checkpoint(llama):
    path, hf, config = llama
    prompt_list = prompts(config.vocab_size)
    cls = make_llm(path, pooler_config='{"pooling_type": "CLS"}')  # mean in the checkpoint; CLS here
    assert_close(embed(cls, prompt_list), [hf_hidden_states(hf, p)[0] for p in prompt_list])
    last = make_llm(path, pooler_config='{"pooling_type": "LAST", "normalize": true}')
    assert_close(embed(last, prompt_list), [F.normalize(hf_hidden_states(hf, p)[-1], dim=-1) for p in prompt_list])


def test_prompt_may_fill_max_model_len_and_no_more(qwen3):
    path, hf, config = qwen3
    llm = make_llm(path, max_model_len=32)
    prompt = prompts(config.vocab_size)[2][:32]
    assert_close(embed(llm, [prompt]), [F.normalize(hf_hidden_states(hf, prompt)[-1], dim=-1)])
    with pytest.raises(ValueError, match=r"prompt_token_ids: the prompt \(length 33\) is longer than the maximum"):
        llm.embed([{"prompt_token_ids": prompt + [3]}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids: the prompt is empty"):
        llm.embed([{"prompt_token_ids": []}], use_tqdm=False)
    assert_no_leaks(llm.engine)


def test_each_runner_refuses_the_other_kind_of_request(qwen3, tmp_path):
    path, _, config = qwen3
    pooling = make_llm(path)
    with pytest.raises(ValueError, match="runs --runner pooling"):
        pooling.generate([[3, 4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
    import transformers

    generative = tmp_path / "llama"
    causal = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON))
    causal.save_pretrained(generative)
    save_word_level_tokenizer(generative, config.vocab_size)
    llm = make_llm(generative)
    assert llm.engine.runner_type == "generate"
    with pytest.raises(ValueError, match="runs --runner generate: it cannot embed"):
        llm.embed([[3, 4, 5]], use_tqdm=False)
    # The same causal LM as a pooling model (vLLM's --runner pooling on a generative checkpoint): LAST, normalised.
    as_pooling = make_llm(generative, runner="pooling")
    with torch.no_grad():
        hidden = causal.model(torch.tensor([[3, 4, 5]])).last_hidden_state[0, -1]
    assert_close(embed(as_pooling, [[3, 4, 5]]), [F.normalize(hidden, dim=-1)])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"runner": "generate"}, "runner generate needs an LM head"),
        ({"pooler_config": '{"pooling_type": "MAX"}'}, "pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"),
        (
            {"pooler_config": '{"dimensions": 8}'},
            r"pooler_config has unknown keys \['dimensions'\]; allowed: pooling_type, normalize",
        ),
        ({"pooler_config": "[1]"}, "pooler_config must be a JSON object"),
        ({"runner": "ponder"}, "runner must be one of auto, generate, pooling"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "decodes nothing"),
    ],
)
def test_bad_runner_settings_are_refused_naming_them(qwen3, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_llm(qwen3[0], **kwargs)


def test_pooler_config_on_a_generating_engine_is_refused(tmp_path):
    import transformers

    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON)).save_pretrained(tmp_path)
    save_word_level_tokenizer(tmp_path, COMMON["vocab_size"])
    with pytest.raises(ValueError, match="pooler_config is set .* but the engine runs generate"):
        make_llm(tmp_path, pooler_config='{"pooling_type": "MEAN"}')


def test_unsupported_sentence_transformers_pooling_is_refused(tmp_path):
    import transformers

    config = transformers.LlamaConfig(**COMMON, architectures=["LlamaModel"])
    save_base_model(tmp_path, config, "max_tokens")
    with pytest.raises(ValueError, match="1_Pooling/config.json: pooling_mode_max_tokens is not implemented"):
        make_llm(tmp_path)
