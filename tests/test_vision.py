"""Vision-language models: LLaVA greedy token-identical to transformers in float32 with 0 to 3 images, an image
across prefill chunks, the encoder cache's sharing and freeing, image-aware prefix-cache block hashes, and the
refusals of bad image input. Tiny random models and generated images only."""

import base64
import io

import numpy as np
import pytest
import torch

from conftest import HFReference, assert_greedy_matches, assert_no_leaks
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.llm import LLM
from engine.multimodal.media import load_data_url
from engine.processor import Processor
from engine.request import Request, SamplingParams

PIL = pytest.importorskip("PIL.Image")

VOCAB = 128
IMAGE_TOKEN = VOCAB - 1  # "<image>"
# 56 x 56 pixels in 14 x 14 patches: 16 embedding tokens an image.
NUM_IMAGE_TOKENS = 16


def save_tiny_llava(path, tower: str = "clip"):
    """A random LLaVA (a CLIP or SigLIP tower, projector, Llama) with a word-level tokenizer ("<i>" is id i,
    "<image>" the image token) and an image processor, saved to path; the transformers model. The SigLIP tower (no
    class token) keeps every patch ("full") from its last layer, before its post-layernorm."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"<{i}>": i for i in range(VOCAB - 1)} | {"<image>": IMAGE_TOKEN}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<0>", bos_token="<1>", eos_token="<2>", pad_token="<0>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.content is string %}{{ m.content }} {% else %}{% for p in m.content %}"
        "{% if p.type == 'image' %}<image> {% else %}{{ p.text }} {% endif %}{% endfor %}{% endif %}{% endfor %}"
    )
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
                 patch_size=14)  # fmt: skip
    siglip = tower == "siglip"
    # SigLIP's pooling head is built and saved, and never read.
    vision = (
        transformers.SiglipVisionConfig(**shape, vision_use_head=True)
        if siglip
        else transformers.CLIPVisionConfig(**shape)
    )
    strategy = "full" if siglip else "default"
    text = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, image_seq_length=NUM_IMAGE_TOKENS,
        vision_feature_select_strategy=strategy, vision_feature_layer=-1 if siglip else -2,
    )  # fmt: skip
    config.initializer_range = 0.5
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy=strategy,
        image_token="<image>",
        num_additional_image_tokens=0 if siglip else 1,
        chat_template=tokenizer.chat_template,
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, processor


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava")
    model, processor = save_tiny_llava(path)
    return path, model, processor


def image(seed: int, size=(40, 50)):
    return PIL.fromarray(np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8))


class WithImages:
    """A transformers model whose generate() also gets the processor's other outputs (pixel_values; Gemma 3's
    token_type_ids), for HFReference."""

    def __init__(self, model, inputs: dict):
        self.model, self.inputs, self.device = model, inputs, model.device

    def generate(self, ids, **kwargs):
        return self.model.generate(ids, **self.inputs, **kwargs)


def hf_greedy(model, processor, prompt: str, images: list, max_new_tokens: int):
    """The prompt's token ids as the processor expands them, and transformers' greedy tokens and logits."""
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    prompt_ids = inputs["input_ids"][0].tolist()
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    reference = HFReference(WithImages(model, extra) if images else model)
    return prompt_ids, *reference.greedy(prompt_ids, max_new_tokens)


PROMPTS = [
    ("<5> <9> <13> <21>", []),
    ("<5> <image> <7> <8>", [image(1)]),
    ("<3> <image> <4> <image> <6>", [image(2), image(3, (60, 30))]),
    ("<image> <10> <image> <11> <12> <image>", [image(4), image(5), image(6)]),
]


def make_llm(path, **kwargs):
    return LLM(str(path), kv_cache_memory="8MiB", block_size=8, **kwargs)


@pytest.mark.parametrize("chunk", [2048, 12])
def test_llava_greedy_matches_transformers_with_0_to_3_images(llava, chunk):
    """chunk 12: every image (16 placeholders) straddles a prefill chunk boundary; it is encoded once all the same."""
    path, model, processor = llava
    llm = make_llm(path, max_num_batched_tokens=chunk, max_num_encoder_input_tokens=64, encoder_cache_size=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in PROMPTS], params)
    for (prompt, images), output in zip(PROMPTS, outputs):
        prompt_ids, reference, logits = hf_greedy(model, processor, prompt, images, 8)
        assert output.prompt_token_ids == prompt_ids
        assert_greedy_matches(output.outputs[0].token_ids, reference, logits, f"{len(images)} images, chunk {chunk}")
    stats = llm.engine.scheduler.encoder_cache_manager.stats
    assert stats.computed == 6  # each distinct image once, however many chunks its placeholders spread over
    assert_no_leaks(llm.engine)


def test_llava_with_a_siglip_tower_matches_transformers(tmp_path):
    """Two images in a prompt, one across a prefill chunk boundary; SigLIP's pooling head in the checkpoint is
    skipped."""
    model, processor = save_tiny_llava(tmp_path, "siglip")
    llm = make_llm(tmp_path, max_num_batched_tokens=12, max_num_encoder_input_tokens=32, encoder_cache_size=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = PROMPTS[:3]
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in prompts], params)
    for (prompt, images), output in zip(prompts, outputs):
        prompt_ids, reference, logits = hf_greedy(model, processor, prompt, images, 8)
        assert output.prompt_token_ids == prompt_ids
        assert_greedy_matches(output.outputs[0].token_ids, reference, logits, f"SigLIP, {len(images)} images")
    assert_no_leaks(llm.engine)


def test_chat_with_data_url_images_matches_generate(llava):
    path, model, processor = llava
    llm = make_llm(path)
    buffer = io.BytesIO()
    image(7).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "<5>"}, {"type": "image_url", "image_url": {"url": url}}]}
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [chat] = llm.chat(messages, params)
    prompt_ids, reference, logits = hf_greedy(model, processor, "<5> <image> ", [load_data_url(url, "url")], 6)
    assert chat.prompt_token_ids == prompt_ids
    assert_greedy_matches(chat.outputs[0].token_ids, reference, logits, "chat")


def mm_request(llm, request_id, prompt, images, max_tokens=4):
    token_ids, features = llm.mm_processor(prompt, None, images)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, token_ids, params, mm_features=features)


def run(engine, requests):
    for r in requests:
        engine.add_request(r)
    tokens = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_encoder_cache_is_shared_by_requests_with_the_same_image_and_freed_after(llava):
    path, _, _ = llava
    llm = make_llm(path, enable_prefix_caching=False)
    engine, manager = llm.engine, llm.engine.scheduler.encoder_cache_manager
    same = [mm_request(llm, str(i), f"<{5 + i}> <image> <7>", [image(11)]) for i in range(2)]
    tokens = run(engine, same)
    assert manager.stats.computed == 1 and manager.stats.hits == 1  # the second request read the first's
    # Nobody needs it now: the whole cache is free to reuse, but the entry stays until its room is needed.
    assert manager.num_freeable_slots == manager.cache_size and manager.usage() == 0.0
    later = mm_request(llm, "later", "<6> <image> <7>", [image(11)])
    assert run(engine, [later])["later"] == tokens["1"]
    assert manager.stats.computed == 1 and manager.stats.hits == 2
    assert set(engine.worker.model_runner.encoder_cache) == {same[0].mm_features[0].identifier}
    assert_no_leaks(engine)


def test_freeable_embeddings_are_evicted_when_their_room_is_needed(llava):
    path, _, _ = llava
    llm = make_llm(path, max_num_encoder_input_tokens=16, encoder_cache_size=32)
    engine, manager = llm.engine, llm.engine.scheduler.encoder_cache_manager
    for i in range(3):
        run(engine, [mm_request(llm, str(i), "<5> <image>", [image(20 + i)])])
    assert manager.stats.computed == 3 and len(manager.cached) == 2  # the oldest made room for the third
    assert len(engine.worker.model_runner.encoder_cache) <= 3  # the runner drops it with the next step
    run(engine, [mm_request(llm, "x", "<5> <6>", [])])
    assert set(engine.worker.model_runner.encoder_cache) == set(manager.cached)


def test_same_text_different_images_never_share_blocks(llava):
    path, _, _ = llava
    llm = make_llm(path)
    engine = llm.engine
    # 2 text tokens, 16 placeholders, 14 text tokens: blocks of 8 are [text text img*6], [img*8], [img*2 text*6]...
    text = "<3> <4> <image> " + " ".join(f"<{10 + i}>" for i in range(14))
    first, second, again = (
        mm_request(llm, rid, text, [image(seed)]) for rid, seed in (("a", 30), ("b", 31), ("c", 30))
    )
    run(engine, [first])
    run(engine, [second])
    assert second.num_cached_tokens == 0  # block 0 already holds image placeholders
    assert not set(first.block_hashes) & set(second.block_hashes)
    run(engine, [again])
    assert again.num_cached_tokens == 24  # the same image: every full prompt block (the last token is recomputed)
    assert again.block_hashes[:4] == first.block_hashes[:4]


def test_text_blocks_before_an_image_are_still_shared(llava):
    path, _, _ = llava
    llm = make_llm(path)
    prefix = " ".join(f"<{10 + i}>" for i in range(8))
    a, b = (mm_request(llm, rid, prefix + " <image> <3>", [image(seed)]) for rid, seed in (("a", 40), ("b", 41)))
    run(llm.engine, [a])
    run(llm.engine, [b])
    assert (
        b.num_cached_tokens == 8 and a.block_hashes[0] == b.block_hashes[0] and a.block_hashes[1] != b.block_hashes[1]
    )


def test_bad_image_input_is_refused_naming_the_item(llava):
    path, _, _ = llava
    llm = make_llm(path, limit_mm_per_prompt=2, max_image_pixels=50 * 50)
    one = {"image": [image(1)]}
    with pytest.raises(ValueError, match=r"3 images, more than limit_mm_per_prompt=2"):
        llm.generate({"prompt": "<image> <image> <image>", "multi_modal_data": {"image": [image(i) for i in range(3)]}})
    with pytest.raises(ValueError, match=r"image\[0\]: 60x60 = 3600 pixels, more than max_image_pixels=2500"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": image(1, (60, 60))}})
    with pytest.raises(ValueError, match=r"multi_modal_data.image: .*0 <image> tokens and 1 images"):
        llm.generate({"prompt": "<5> <6>", "multi_modal_data": one})
    with pytest.raises(ValueError, match=r"modalities \['video'\] are not supported"):
        llm.generate({"prompt": "<5>", "multi_modal_data": {"video": [1]}})
    with pytest.raises(ValueError, match=r"image\[0\] must be a PIL image"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": "x.png"}})
    for url, shown in [
        ("https://example.com/a.png", "only data: URLs"),
        ("data:text/plain;base64,aGVsbG8=", "MIME type 'text/plain'"),
        ("data:image/png;base64,iVBORw0KGgo=", "not a readable image"),
    ]:
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.image_url: " + shown):
            llm.chat(messages)
    assert not llm.engine.has_unfinished_requests()


def test_core_refuses_placeholders_that_do_not_match_the_images(llava):
    """What a front end that preprocessed the images (tensors, ranges, hashes) is checked against."""
    path, _, _ = llava
    llm = make_llm(path)
    token_ids, [feature] = llm.mm_processor("<5> <image> <6>", None, [image(1)])
    processor = llm.processor
    params = SamplingParams(max_tokens=2)
    shifted = type(feature)(feature.data, feature.identifier, type(feature.mm_position)(0, NUM_IMAGE_TOKENS))
    with pytest.raises(ValueError, match=r"image\[0\]: placeholder \[0, 16\) holds tokens other than image token"):
        processor.process_inputs("r", token_ids, params, mm_features=[shifted])
    short = type(feature)(feature.data, feature.identifier, type(feature.mm_position)(1, 8))
    with pytest.raises(ValueError, match=r"image\[0\]: its placeholder has 8 tokens, but the image has 16"):
        processor.process_inputs("r", token_ids, params, mm_features=[short])
    bad = type(feature)({"pixel_values": torch.zeros(1, 3, 28, 28)}, "x", feature.mm_position)
    with pytest.raises(ValueError, match=r"image\[0\]: pixel_values has shape \(1, 3, 28, 28\), expected"):
        processor.process_inputs("r", token_ids, params, mm_features=[bad])
    with pytest.raises(ValueError, match=r"image\[1\]: .*out of order, overlaps"):
        processor.process_inputs("r", token_ids, params, mm_features=[feature, feature])
    small = Processor.for_engine(EngineCore(EngineArgs(model=str(path), kv_cache_memory="8MiB", block_size=8,
                                                       max_num_batched_tokens=8)))  # fmt: skip
    with pytest.raises(ValueError, match=r"image\[0\]: 16 embedding tokens exceed max_num_encoder_input_tokens=8"):
        small.process_inputs("r", token_ids, params, mm_features=[feature])


def test_a_text_only_model_refuses_images(tiny_llama_dir):
    engine = EngineCore(EngineArgs(model=str(tiny_llama_dir), kv_cache_memory="8MiB", block_size=8))
    feature_like = type("F", (), {})()
    with pytest.raises(ValueError, match=r"multi_modal_data.image: the model takes no images"):
        Processor.for_engine(engine).process_inputs("r", [5, 6], SamplingParams(), mm_features=[feature_like])


def test_lora_is_refused_for_a_vision_language_model(llava):
    path, _, _ = llava
    with pytest.raises(ValueError, match=r"--enable-lora is not implemented for LlavaForConditionalGeneration"):
        EngineCore(EngineArgs(model=str(path), kv_cache_memory="8MiB", block_size=8, enable_lora=True))
