"""Qwen2-VL and Qwen2.5-VL: greedy token-identical to transformers in float32 with 0 to 3 images of different
sizes (dynamic resolution), M-RoPE positions, Qwen2.5's window attention, and an image split across prefill chunks.
Tiny random models, a word-level tokenizer and an image processor saved beside them, generated images only."""

import base64
import io

import numpy as np
import pytest
import torch

from conftest import HFReference, assert_greedy_matches, assert_no_leaks
from engine.llm import LLM
from engine.multimodal.media import load_data_url
from engine.multimodal.processing import expand_image_tokens
from engine.request import SamplingParams

PIL = pytest.importorskip("PIL.Image")

VOCAB = 128
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN = range(VOCAB - 4, VOCAB)
TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)  # fmt: skip
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4),
    # window_size 16 pixels: windows of 2 x 2 merged patches; layer 1 attends over the whole image.
    "qwen2_5_vl": dict(
        depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, num_heads=4, patch_size=4, window_size=16,
        fullatt_block_indexes=[1],
    ),
}  # fmt: skip


def save_tiny_qwen2_vl(path, family: str):
    """A random Qwen2-VL or Qwen2.5-VL with a word-level tokenizer ("<i>" is id i, the vision tokens last) and a
    Qwen2-VL image processor (patches of 4 pixels, 2 x 2 merged, 64 to 48 * 48 pixels), saved to path; the
    transformers model."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"<{i}>": i for i in range(VOCAB - 4)} | {s: VOCAB - 4 + i for i, s in enumerate(SPECIAL)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<0>", bos_token="<1>", eos_token="<2>", pad_token="<0>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.content is string %}{{ m.content }} {% else %}{% for p in m.content %}"
        "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|> {% else %}{{ p.text }} {% endif %}"
        "{% endfor %}{% endif %}{% endfor %}"
    )
    qwen2_5 = family == "qwen2_5_vl"
    config_cls = transformers.Qwen2_5_VLConfig if qwen2_5 else transformers.Qwen2VLConfig
    model_cls = (
        transformers.Qwen2_5_VLForConditionalGeneration if qwen2_5 else transformers.Qwen2VLForConditionalGeneration
    )
    config = config_cls(
        text_config=TEXT,
        vision_config=VISION[family],
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    config.vision_config.initializer_range = 0.5
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 64, "longest_edge": 48 * 48}, patch_size=4, temporal_patch_size=2, merge_size=2
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen2_vl(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_qwen2_vl(path, request.param)
    return path, model, HFReferences(path, model)


def image(seed: int, size=(20, 30)):
    return PIL.fromarray(np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8))


class WithImages:
    """A transformers model whose generate() also gets the images' pixel_values, grids and token types."""

    def __init__(self, model, inputs):
        self.model, self.inputs, self.device = model, inputs, model.device

    def generate(self, ids, **kwargs):
        types = (ids == IMAGE_TOKEN).int()
        return self.model.generate(ids, mm_token_type_ids=types, **self.inputs, **kwargs)


class HFReferences:
    """transformers' greedy run of each prompt, computed once a module."""

    def __init__(self, path, model):
        import transformers

        self.model, self.results = model, {}
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(path)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)

    def greedy(self, prompt: str, images: list, max_new_tokens: int):
        """The prompt's token ids, each image token expanded by its grid as Qwen2VLProcessor does, and transformers'
        greedy tokens and logits."""
        key = (prompt, tuple(id(im) for im in images), max_new_tokens)
        if key not in self.results:
            inputs, text = {}, prompt
            if images:
                processed = self.image_processor(images, return_tensors="pt")
                inputs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
                lengths = (processed["image_grid_thw"].prod(-1) // 4).tolist()
                text = expand_image_tokens(prompt, "<|image_pad|>", lengths)
            prompt_ids = self.tokenizer(text)["input_ids"]
            reference = HFReference(WithImages(self.model, inputs)).greedy(prompt_ids, max_new_tokens)
            self.results[key] = (prompt_ids, *reference)
        return self.results[key]


def vision(n: int = 1) -> str:
    return " ".join(["<|vision_start|><|image_pad|><|vision_end|>"] * n)


# Images of different sizes (dynamic resolution): each its own grid of patches and count of embeddings.
PROMPTS = [
    ("<5> <9> <13> <21>", []),
    (f"<5> {vision()} <7> <8>", [image(1)]),
    (f"<3> {vision()} <4> {vision()} <6>", [image(2, (40, 50)), image(3, (60, 30))]),
    (f"{vision()} <10> {vision(2)} <11> <12>", [image(4), image(5, (40, 50)), image(6, (60, 30))]),
]


@pytest.mark.parametrize("chunk", [2048, 7])
def test_greedy_matches_transformers_with_0_to_3_images(qwen2_vl, chunk):
    """chunk 7: every image's placeholders straddle prefill chunk boundaries; each is encoded once all the same."""
    path, _, references = qwen2_vl
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=8, max_num_batched_tokens=chunk,
              max_num_encoder_input_tokens=64, encoder_cache_size=128)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in PROMPTS], params)
    for (prompt, images), output in zip(PROMPTS, outputs):
        prompt_ids, reference, logits = references.greedy(prompt, images, 8)
        assert output.prompt_token_ids == prompt_ids
        assert_greedy_matches(output.outputs[0].token_ids, reference, logits, f"{len(images)} images, chunk {chunk}")
    assert llm.engine.scheduler.encoder_cache_manager.stats.computed == 6
    assert_no_leaks(llm.engine)


def test_chat_with_a_data_url_image_matches_transformers(qwen2_vl):
    path, _, references = qwen2_vl
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=8)
    buffer = io.BytesIO()
    image(7, (33, 41)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "text", "text": "<5>"}, {"type": "image_url", "image_url": {"url": url}}]
    [chat] = llm.chat(
        [{"role": "user", "content": content}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    prompt_ids, reference, logits = references.greedy(f"<5> {vision()} ", [load_data_url(url, "url")], 6)
    assert chat.prompt_token_ids == prompt_ids
    assert_greedy_matches(chat.outputs[0].token_ids, reference, logits, "chat")


def test_images_that_do_not_match_their_grid_or_placeholders_are_refused(qwen2_vl):
    path, _, _ = qwen2_vl
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=8)
    token_ids, [feature] = llm.mm_processor(f"<5> {vision()} <6>", None, [image(1)])
    assert feature.mm_position.length == 8 and feature.data["image_grid_thw"].tolist() == [[1, 4, 8]]
    params = SamplingParams(max_tokens=2)
    for data, shown in [
        ({**feature.data, "image_grid_thw": torch.tensor([[1, 4, 4]])}, r"pixel_values has shape \(32, 96\), expected"),
        ({**feature.data, "image_grid_thw": torch.tensor([[1, 3, 8]])}, r"image_grid_thw \[1, 3, 8\] has a side"),
    ]:
        bad = type(feature)(data, feature.identifier, feature.mm_position)
        with pytest.raises(ValueError, match=r"multi_modal_data.image\[0\]: " + shown):
            llm.processor.process_inputs("r", token_ids, params, mm_features=[bad])
    with pytest.raises(ValueError, match=r"the prompt holds 2 <\|image_pad\|> tokens and 1 images"):
        llm.generate({"prompt": vision(2), "multi_modal_data": {"image": [image(1)]}})


def test_an_unimplemented_config_value_is_refused_naming_it(qwen2_vl):
    import json

    from engine.models.config import ModelArchConfig, ModelLoadError

    path, _, _ = qwen2_vl
    config = json.loads((path / "config.json").read_text())
    wrong = json.loads(json.dumps(config))
    wrong["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    with pytest.raises(ModelLoadError, match=r"mrope_section=\[2, 2, 2\] is not implemented for head_dim 16"):
        ModelArchConfig.from_hf_config(wrong)
    wrong = json.loads(json.dumps(config))
    wrong["vision_config"]["deepstack_visual_indexes"] = [1]
    with pytest.raises(ModelLoadError, match=r"vision_config fields \['deepstack_visual_indexes'\]"):
        ModelArchConfig.from_hf_config(wrong)


def test_encoder_cache_stats_and_each_requests_encoder_runs(qwen2_vl):
    """SchedulerStats reports the encoder cache's usage and hits; a request's metrics hold the encoder's run for each
    image computed for it (the trace's encoder spans), none for an image another request's run left cached."""
    path, _, _ = qwen2_vl
    llm = LLM(str(path), kv_cache_memory="8MiB", block_size=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    [first] = llm.generate({"prompt": f"<5> {vision()}", "multi_modal_data": {"image": image(9, (40, 50))}}, params)
    [again] = llm.generate({"prompt": f"<6> {vision()}", "multi_modal_data": {"image": image(9, (40, 50))}}, params)
    [(start, end, tokens)] = first.metrics.encoder_runs
    assert tokens == 30 and first.metrics.arrival_time <= start <= end <= first.metrics.first_token_time
    assert again.metrics.encoder_runs == []
    stats = llm.engine.scheduler.make_stats()
    assert (stats.encoder_cache_stats.queries, stats.encoder_cache_stats.hits) == (2, 1)
    assert stats.encoder_cache_stats.computed == 1 and stats.encoder_cache_usage == 0.0
