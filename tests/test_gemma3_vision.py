"""Gemma 3 with its vision tower (Gemma3ForConditionalGeneration): greedy token-identical to transformers in float32
with 0 to 2 images, chunked or not, on the torch and CPU attention backends; each image's placeholders attend to
each other both ways, so a prefill chunk never splits them, a prefix-cache hit may end inside one, and the
sliding-window layers still bound the keys before a query. Tiny random model and generated images only."""

import pytest
import torch
from test_vision import hf_greedy, image

from conftest import assert_greedy_matches, assert_no_leaks
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.llm import LLM
from engine.models.config import ModelArchConfig, ModelLoadError
from engine.request import Request, SamplingParams

VOCAB = 128
BOI, EOI, IMAGE_TOKEN = VOCAB - 3, VOCAB - 2, VOCAB - 1
# 32 x 32 pixels in 8 x 8 patches, pooled 2 x 2: 4 embedding tokens an image.
NUM_IMAGE_TOKENS = 4


def gemma3_vision_config():
    import transformers

    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8,
        vision_use_head=False,
    )  # fmt: skip
    # A window of 3 on the sliding layers, shorter than an image: there a placeholder sees the ones after it in its
    # image, but not the first ones before it.
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, sliding_window=3, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    config = transformers.Gemma3Config(
        vision_config=vision, text_config=text, mm_tokens_per_image=NUM_IMAGE_TOKENS, boi_token_index=BOI,
        eoi_token_index=EOI, image_token_index=IMAGE_TOKEN,
    )  # fmt: skip
    config.initializer_range = 0.3
    return config


@pytest.fixture(scope="module")
def gemma3v(tmp_path_factory):
    """A random model saved with a word-level tokenizer ("<i>" is id i; "<boi>" in a prompt stands for an image, which
    the processor expands to <boi>, its placeholders and <eoi>) and Gemma 3's image processor; the transformers
    model and processor."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"<{i}>": i for i in range(BOI)} | {"<boi>": BOI, "<eoi>": EOI, "<img>": IMAGE_TOKEN}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<boi>", "<eoi>", "<img>")])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<0>", bos_token="<1>", eos_token="<2>", pad_token="<0>",
        extra_special_tokens={"boi_token": "<boi>", "eoi_token": "<eoi>", "image_token": "<img>"},
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-gemma3-vision")
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(gemma3_vision_config()).eval()
    model.save_pretrained(path)
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_length=NUM_IMAGE_TOKENS
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, processor


PROMPTS = [
    ("<5> <9> <13> <21>", []),
    ("<5> <boi> <7> <8>", [image(1)]),
    ("<3> <boi> <4> <boi> <6>", [image(2), image(3, (60, 30))]),
    ("<boi> <10> <11> <boi> <12>", [image(4), image(4)]),  # the same image twice: encoded once
]


def make_llm(path, **kwargs):
    return LLM(str(path), kv_cache_memory="8MiB", block_size=8, **kwargs)


PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=4)


def assert_matches(output, reference, logits, label):
    """Greedy tokens as transformers', and up to any near-tie the top logprobs within 1e-3 of its: an image seen
    one way only moves them by far more, though the tiny model's greedy choices may not change."""
    ours = output.outputs[0].token_ids
    assert_greedy_matches(ours, reference, logits, label)
    same = next((n for n, (a, b) in enumerate(zip(ours, reference)) if a != b), len(ours))
    top = [sorted((lp.logprob for lp in step.values()), reverse=True)[:4] for step in output.outputs[0].logprobs]
    expected = logits.log_softmax(-1).topk(4).values[:same]
    torch.testing.assert_close(torch.tensor(top[:same]), expected, atol=1e-3, rtol=0, msg=label)


# The CPU backend hands the steps that hold placeholders to the torch backend: one CPU case covers it.
@pytest.mark.parametrize("backend, chunk", [("cpu", 2048), ("torch", 2048), ("torch", 5)], ids=lambda x: str(x))
def test_gemma3_vision_greedy_matches_transformers_with_0_to_2_images(gemma3v, backend, chunk):
    """chunk 5: a chunk boundary falls inside every image (boi and 4 placeholders), which the scheduler moves to
    before it."""
    path, model, processor = gemma3v
    llm = make_llm(path, attention_backend=backend, max_num_batched_tokens=chunk)
    assert llm.engine.executor.attention_backend == backend
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in PROMPTS], PARAMS)
    for (prompt, images), output in zip(PROMPTS, outputs):
        prompt_ids, reference, logits = hf_greedy(model, processor, prompt, images, 8)
        assert output.prompt_token_ids == prompt_ids
        assert_matches(output, reference, logits, f"{len(images)} images, chunk {chunk}")
    assert llm.engine.scheduler.encoder_cache_manager.stats.computed == 4
    assert_no_leaks(llm.engine)


def mm_request(llm, request_id, prompt, images, max_tokens=8):
    token_ids, features = llm.mm_processor(prompt, None, images)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, token_ids, params, mm_features=features)


def test_prefill_chunks_never_split_an_image(gemma3v):
    path, _, _ = gemma3v
    llm = make_llm(path, max_num_batched_tokens=6)
    engine = llm.engine
    request = mm_request(llm, "r", "<3> <4> <5> <boi> <6> <boi> <7> <8> <9>", [image(1), image(2)])
    spans = [(f.mm_position.offset, f.mm_position.end) for f in request.mm_features]
    assert spans == [(4, 8), (11, 15)]
    engine.add_request(request)
    ends = []
    while request.num_computed_tokens < request.num_prompt_tokens:
        engine.step()
        ends.append(request.num_computed_tokens)
    # Unsplit, the chunks would end at 6 and 12, inside the images.
    assert ends == [4, 10, 16, 19]
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


def test_a_prefix_cache_hit_inside_an_image_matches_transformers(gemma3v):
    """The second prompt shares the first's text and image up to the end of block 0, three placeholders into the
    image: its prefill starts inside the image and takes the rest of it in one step."""
    path, model, processor = gemma3v
    llm = make_llm(path)
    first, second = "<3> <4> <5> <6> <boi> <7> <8>", "<3> <4> <5> <6> <boi> <9> <10> <11>"
    llm.generate({"prompt": first, "multi_modal_data": {"image": image(5)}}, PARAMS)
    [output] = llm.generate({"prompt": second, "multi_modal_data": {"image": image(5)}}, PARAMS)
    assert output.num_cached_tokens == 8
    prompt_ids, reference, logits = hf_greedy(model, processor, second, [image(5)], 8)
    assert output.prompt_token_ids == prompt_ids and prompt_ids[5:9] == [IMAGE_TOKEN] * NUM_IMAGE_TOKENS
    assert_matches(output, reference, logits, "hit inside the image")
    assert_no_leaks(llm.engine)


def test_what_is_not_implemented_is_refused_by_name(gemma3v):
    path, _, _ = gemma3v
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=3 is less than an image's 4 placeholder tokens"):
        EngineCore(EngineArgs(model=str(path), kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=3))
    with pytest.raises(ValueError, match=r"--attention-backend triton does not implement mm_prefix"):
        EngineCore(EngineArgs(model=str(path), kv_cache_memory="8MiB", block_size=8, attention_backend="triton"))
    d = gemma3_vision_config().to_dict()
    d.pop("architectures", None)  # read by its model_type
    config = ModelArchConfig.from_hf_config(d)
    assert config.architecture == "Gemma3ForConditionalGeneration" and config.layer_types[0] == "sliding_attention"
    assert "mm_prefix" in config.attention_features()
    for changes, shown in [
        ({"mm_tokens_per_image": 3}, "mm_tokens_per_image=3 is not implemented"),
        (
            {"vision_config": {**d["vision_config"], "model_type": "clip_vision_model"}},
            "model_type 'clip_vision_model'",
        ),
        ({"vision_config": {**d["vision_config"], "hidden_act": "relu"}}, "vision_config.hidden_act='relu'"),
    ]:
        with pytest.raises(ModelLoadError, match=shown):
            ModelArchConfig.from_hf_config({**d, **changes})
