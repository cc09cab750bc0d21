"""The engine's other features with images, on the tiny random LLaVA of test_vision.py: preemption (recomputed
images give the same tokens), the KV store (blocks named by their images' hashes: a second engine loads them, a
different image with the same text loads nothing), prefill on one engine and decode on another, structured output
and n-gram speculative decoding. Greedy float32 output is held to transformers on the same weights."""

import json

import pytest
import torch
from test_kv_connector import kvstore, settle  # noqa: F401 (the kvstore fixture, on conftest's real redis)
from test_vision import IMAGE_TOKEN, hf_greedy, image, mm_request, run, save_tiny_llava

from conftest import assert_greedy_matches, assert_no_leaks, loading_kv_config
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request

BLOCK = 8
# One block of the tiny LLaVA's language model in float32: K and V of 2 layers, 2 KV heads of 16.
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava-features")
    model, processor = save_tiny_llava(path)
    return path, model, processor


def engine(path, **args) -> EngineCore:
    args.setdefault("kv_cache_memory", "8MiB")
    return EngineCore(EngineArgs(model=str(path), block_size=BLOCK, **args))


def check_against_hf(llava, requests, tokens: dict, label: str) -> None:
    """Each request's tokens against transformers' greedy tokens on its prompt and images."""
    _, model, processor = llava
    for prompt, images, request in requests:
        prompt_ids, reference, logits = hf_greedy(model, processor, prompt, images, request.sampling_params.max_tokens)
        assert request.prompt_token_ids == prompt_ids
        assert_greedy_matches(tokens[request.request_id], reference, logits, f"{label} {request.request_id}")


def assert_encoder_cache_consistent(core: EngineCore) -> None:
    """The runner holds exactly the embeddings the scheduler's encoder cache accounts for (after one more step)."""
    run(core, [Request("flush", [5, 6], SamplingParams(max_tokens=1))])
    manager = core.scheduler.encoder_cache_manager
    assert set(core.worker.model_runner.encoder_cache) == set(manager.cached)
    assert manager.num_freeable_slots == manager.cache_size  # no request holds any


# ---- preemption ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_vision_requests_recompute_the_same_tokens(llava, prefix_caching):
    """A pool of 10 blocks for 4 requests of about 6 blocks each: requests are preempted and recomputed, images
    included; an encoder cache of two images' room makes some of them encode again. The tokens are transformers'."""
    path, _, processor = llava
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=BLOCK)  # its processor only
    specs = [
        ("<5> <image> <7> <8>", [image(50)]),
        ("<3> <image> <4> <image> <6>", [image(51), image(52)]),
        ("<9> <10> <image>", [image(53)]),
        ("<image> <11> <12>", [image(50)]),
    ]
    requests = [(p, im, mm_request(llm, str(i), p, im, max_tokens=24)) for i, (p, im) in enumerate(specs)]
    core = engine(
        path,
        kv_cache_memory=str(10 * BLOCK_BYTES),
        enable_prefix_caching=prefix_caching,
        max_num_encoder_input_tokens=32,
        encoder_cache_size=32,
    )
    tokens = run(core, [r for _, _, r in requests])
    assert core.scheduler.num_preemptions > 0
    check_against_hf(llava, requests, tokens, "preempted")
    if not prefix_caching:  # every preempted request's images are needed again; some were evicted meanwhile
        assert core.scheduler.encoder_cache_manager.stats.computed > 4
    assert_no_leaks(core)
    assert_encoder_cache_consistent(core)


# ---- the KV store ---------------------------------------------------------------------------------------------------


def store_engine(path, address: str, role: str = "kv_both", **args) -> EngineCore:
    config = loading_kv_config(address, role)
    return engine(path, kv_transfer_config=config, **args)


def loaded_tokens(core: EngineCore) -> int:
    return core.get_stats().kv_connector_stats["loaded_tokens"]


def test_kv_store_keys_blocks_by_their_images(llava, kvstore):
    """Blocks with image placeholders are stored under hashes that include the image's: a second engine loads
    them and gives the same tokens; the same text with another image loads none of them."""
    path, _, _ = llava
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=BLOCK)
    tail = " ".join(f"<{10 + i}>" for i in range(14))
    # 2 + 16 + 14 = 32 tokens: blocks 0-2 hold placeholders, block 3 text; and 18 tokens, ending inside block 2.
    specs = [("<3> <4> <image> " + tail, [image(60)]), ("<3> <5> <image>", [image(61)])]

    def requests(tag, images_of=lambda im: im):
        return [
            (p, images_of(im), mm_request(llm, f"{tag}{i}", p, images_of(im), 6)) for i, (p, im) in enumerate(specs)
        ]

    first = store_engine(path, kvstore.address)
    cold = requests("cold")
    tokens = run(first, [r for _, _, r in cold])
    check_against_hf(llava, cold, tokens, "cold")
    settle(first)
    assert first.get_stats().kv_connector_stats["stored_blocks"] == 4 + 2

    second = store_engine(path, kvstore.address)
    warm = requests("warm")
    tokens = run(second, [r for _, _, r in warm])
    check_against_hf(llava, warm, tokens, "loaded")
    # Every full block but the last prompt token's; the second prompt's image is completed by the encoder.
    assert loaded_tokens(second) == 24 + 16
    assert second.scheduler.encoder_cache_manager.stats.computed == 1
    settle(second)

    other = requests("other", lambda im: [image(62)])
    tokens = run(second, [r for _, _, r in other])
    check_against_hf(llava, other, tokens, "another image")
    assert loaded_tokens(second) == 24 + 16  # nothing more: each block holds placeholders of the other image
    assert all(r.num_cached_tokens == 0 for _, _, r in other)
    settle(second)
    assert_no_leaks(second)
    first.shutdown()
    second.shutdown()


def test_prefill_on_one_engine_and_decode_on_another_with_an_image(llava, kvstore):
    """vLLM's P/D: the producer prefills the prompt, image included, and stores its blocks; the consumer, given the
    same images, loads them instead of computing them and decodes the tokens one engine alone gives."""
    path, _, _ = llava
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=BLOCK)
    prompt, images = (
        "<3> <image> " + " ".join(f"<{20 + i}>" for i in range(10)) + " <image> <4>",
        [image(70), image(71)],
    )
    producer = store_engine(path, kvstore.address, "kv_producer")
    consumer = store_engine(path, kvstore.address, "kv_consumer")

    def request(rid, max_tokens, params):
        r = mm_request(llm, rid, prompt, images, max_tokens)
        r.kv_transfer_params = params
        return r

    run(producer, [request("p", 1, {"do_remote_decode": True})])
    decoded = request("d", 8, {"do_remote_prefill": True})
    tokens = run(consumer, [decoded])
    check_against_hf(llava, [(prompt, images, decoded)], tokens, "P/D")
    num_prompt = len(decoded.prompt_token_ids)
    assert loaded_tokens(consumer) == (num_prompt - 1) // BLOCK * BLOCK
    # Both images' placeholders lie in the loaded blocks but the second's last token: only it is encoded.
    assert consumer.scheduler.encoder_cache_manager.stats.computed == 1
    settle(producer)
    settle(consumer)
    assert_no_leaks(consumer)
    producer.shutdown()
    consumer.shutdown()


# ---- structured output and speculative decoding ------------------------------------------------------------------------


def test_structured_output_with_an_image_is_transformers_masked_greedy(llava):
    """A regex over the word-level vocabulary ("<i>" tokens) on a prompt with an image: the tokens are transformers'
    greedy choices among the tokens the regex allows at each position, and the request ends when the regex does."""
    path, model, processor = llava
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=BLOCK)
    prompt, images = "<5> <image> <7>", [image(80)]
    allowed = list(range(10, 20))  # <10> .. <19>
    params = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex="(<1[0-9]>){5}")
    )
    [output] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params, use_tqdm=False)
    ours = output.outputs[0].token_ids

    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    eos = model.config.text_config.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=6,
            do_sample=False,
            prefix_allowed_tokens_fn=lambda _, ids: (
                allowed if ids.shape[0] < inputs["input_ids"].shape[1] + 5 else [eos]
            ),
        )
    reference = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert ours == reference and output.outputs[0].finish_reason == "stop"
    assert_no_leaks(llm.engine)


def test_ngram_speculation_with_images_equals_transformers(llava):
    path, _, _ = llava
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=BLOCK)
    repeat = " ".join(["<5> <6> <7> <8>"] * 3)
    specs = [
        (f"{repeat} <image> {repeat}", [image(90)]),
        ("<3> <image> <4> <image> <3> <4>", [image(91), image(92)]),
    ]
    requests = [(p, im, mm_request(llm, str(i), p, im, max_tokens=32)) for i, (p, im) in enumerate(specs)]
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    core = engine(path, speculative_config=json.dumps(ngram), max_num_batched_tokens=16)
    tokens = run(core, [r for _, _, r in requests])
    check_against_hf(llava, requests, tokens, "ngram")
    stats = core.get_stats().spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    # Drafts copied from the prompt may be the image token: as text tokens they are only ever verified.
    assert IMAGE_TOKEN in {t for _, _, r in requests for t in r.prompt_token_ids}
    assert_no_leaks(core)


# ---- the encoder cache kept or not ----------------------------------------------------------------------------------


def test_encoder_cache_keep_unused_off_drops_embeddings_no_request_needs(llava):
    """Off: an image's embeddings go as soon as no request needs them, so a later request with the same image encodes
    it again (same tokens); requests that need it at the same time still share one encoding."""
    path, _, _ = llava
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=BLOCK)
    core = engine(path, enable_prefix_caching=False, encoder_cache_keep_unused=False)
    manager, runner = core.scheduler.encoder_cache_manager, core.worker.model_runner
    together = [mm_request(llm, str(i), f"<{5 + i}> <image> <7>", [image(100)]) for i in range(2)]
    tokens = run(core, together)
    assert manager.stats.computed == 1 and manager.stats.hits == 1
    assert not manager.cached and manager.num_free_slots == manager.cache_size
    later = mm_request(llm, "later", "<6> <image> <7>", [image(100)])
    assert run(core, [later])["later"] == tokens["1"]
    assert manager.stats.computed == 2
    assert_no_leaks(core)
    assert_encoder_cache_consistent(core)
    assert not runner.encoder_cache
