"""Shared fixtures: the real SmolLM2 model, and Hugging Face transformers as the oracle."""

import functools

import pytest
import torch

from engine.models.loader import DEFAULT_MODEL, load_tokenizer, prepare_model_dir, resolve_model

# One float32 KV block of SmolLM2: K and V x 30 layers x 16 tokens x 3 KV heads x 64 dims x 4 bytes.
SMOLLM2_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4

# Where greedy choices differ, the reference's top two logits there must be this close (DESIGN §6).
NEAR_TIE = 1e-3


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir():
    return prepare_model_dir(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


class HFReference:
    """Greedy generation (EOS off, so exactly max_new_tokens) and the logits behind each choice."""

    def __init__(self, model):
        self.model = model

    @functools.lru_cache(maxsize=None)
    def _greedy(self, prompt: tuple[int, ...], max_new_tokens: int):
        ids = torch.tensor([prompt], device=self.model.device)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logits = torch.stack([step[0] for step in out.logits]).float().cpu()
        return tokens, logits

    def greedy(self, prompt, max_new_tokens):
        return self._greedy(tuple(prompt), max_new_tokens)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers loading the GGUF with its own dequantizer, independent of our converter."""
    from transformers import AutoModelForCausalLM

    gguf = resolve_model(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return HFReference(model.eval())


def assert_greedy_matches(ours: list[int], reference: list[int], ref_logits: torch.Tensor, label=""):
    """Token-identical, except that after a near-tie in the reference the two may diverge."""
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap <= NEAR_TIE, f"{label}: token {i} differs ({a} vs reference {b}) and is no near-tie (gap {gap:.4g})"
            return False
    assert len(ours) == len(reference), f"{label}: {len(ours)} tokens vs reference {len(reference)}"
    return True


def run_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Drive an EngineCore step by step over greedy requests; the tokens of each, in order."""
    from engine.request import Request, SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(Request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def assert_no_leaks(engine):
    """No request left, and every block free (or free and still cached)."""
    assert not engine.scheduler.requests
    assert not engine.scheduler.running and len(engine.scheduler.waiting) == 0
    manager = engine.kv_cache_manager
    assert not manager.req_to_blocks
    assert manager.get_num_free_blocks() == manager.num_blocks
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)
