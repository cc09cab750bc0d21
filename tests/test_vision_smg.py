"""Images through smg (the PyPI router) and the engine's VllmEngine port, on the tiny random LLaVA of test_vision.py.

- A real OpenAI client sends `image_url` content parts holding data: URLs to `smg launch --mm-processing router`,
  which preprocesses the images itself and sends their tensors and placeholder ranges (GenerateRequest.mm_inputs):
  greedy tokens equal the offline LLM's with the same images.
- media_refs (the worker preprocesses: data: URLs, file: URLs under --allowed-local-media-path) are sent to the
  port directly, in the shape the router sends them (token ids with one unexpanded placeholder an image): smg
  1.13's LLaVA processor is not "worker expandable", so smg itself never sends them for this model.
- Bad input is refused INVALID_ARGUMENT naming the item, and the engine serves on.
"""

import base64
import contextlib
import re

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc
from test_interop import SmgRouter, free_port, smg_missing
from test_vision import IMAGE_TOKEN, image
from test_vision_services import llava_dir, llm, media_dir, png  # noqa: F401 (fixtures)

from conftest import InProcessService
from engine.request import SamplingParams

PIL = pytest.importorskip("PIL.Image")
openai = pytest.importorskip("openai")

MAX_TOKENS = 6


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def llava_15_dir(llava_dir, tmp_path_factory):
    """The tiny LLaVA under a name smg knows: it picks its image processor by the model's name ("llava-1.5")."""
    link = tmp_path_factory.mktemp("models") / "llava-1.5-tiny"
    link.symlink_to(llava_dir)
    return link


@pytest.fixture(scope="module")
def engine(llava_15_dir, media_dir):
    """The engine's VllmEngine on a plaintext loopback port (smg reaches workers in plaintext only)."""
    port = free_port()
    flags = ["--model", llava_15_dir, "--kv-cache-memory", "8MiB", "--block-size", "8", "--vllm-plaintext-port", port,
             "--allowed-local-media-path", media_dir, "--limit-mm-per-prompt", "2", "--max-image-pixels", 60 * 60,
             "--shutdown-timeout", "5"]  # fmt: skip
    with InProcessService("engine", flags) as service, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield service, f"127.0.0.1:{port}", vllm_engine_pb2_grpc.VllmEngineStub(channel)


@pytest.fixture(scope="module")
def smg(engine, llava_15_dir, tmp_path_factory):
    reason = smg_missing()
    if reason:
        pytest.skip(reason)
    router = SmgRouter(
        [engine[1]], llava_15_dir, tmp_path_factory.mktemp("smg") / "smg.log", ["--mm-processing", "router"]
    )
    try:
        yield router, router.wait_ready()
    finally:
        router.stop()


def offline(llm, prompt: str, images: list) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [out] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)
    return list(out.outputs[0].token_ids)


def token_ids(text: str) -> list[int]:
    """The word-level tokenizer's text back as ids ("<i>" is id i)."""
    return [IMAGE_TOKEN if t == "image" else int(t) for t in re.findall(r"<(\w+)>", text)]


def test_openai_client_image_urls_through_smg_match_offline(smg, llm):
    """smg resizes with a resampler of its own (its pixels differ from PIL's by up to 0.23 after normalization at
    40 x 50), so the images are sent at the processor's 56 x 56, where both only rescale and normalize. smg puts a
    message's images before its text, so they come first here."""
    router, model = smg
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused")
    for seeds in ([1], [2, 5]):
        parts = [{"type": "image_url", "image_url": {"url": data_url(png(s, (56, 56)))}} for s in seeds]
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "<5>"}]}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )
        # The template renders "<image> ... <5>", each <image> expanded to the image's 16 placeholders.
        expected = offline(llm, "<image> " * len(seeds) + "<5>", [image(s, (56, 56)) for s in seeds])
        assert token_ids(reply.choices[0].message.content) == expected
        assert reply.usage.prompt_tokens == 16 * len(seeds) + 1


def generate(stub, input_ids, **fields) -> list[int]:
    request = vllm_engine_pb2.GenerateRequest(
        request_id="r",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=input_ids),
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
        **fields,
    )
    return [t for r in stub.Generate(request) for t in r.complete.output_ids]


def refs(*urls) -> vllm_engine_pb2.MediaRefs:
    return vllm_engine_pb2.MediaRefs(
        items=[vllm_engine_pb2.MediaRef(modality=smg_common_pb2.IMAGE, url=url) for url in urls]
    )


def test_media_refs_are_preprocessed_by_the_worker_and_match_offline(engine, llm, media_dir):
    _, _, stub = engine
    # One unexpanded <image> an item: the worker expands it to the image's placeholders.
    prompt_ids = [5, IMAGE_TOKEN, 7, IMAGE_TOKEN, 9]
    media = refs(data_url(png(1)), f"file://{media_dir / 'a.png'}")
    assert generate(stub, prompt_ids, media_refs=media) == offline(
        llm, "<5> <image> <7> <image> <9>", [image(1), image(3)]
    )
    info = stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
    assert (info.mm_processor, info.mm_media_ref_schemes, info.mm_item_limits) == ("inprocess", "data,file", "image=2")
    assert stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest()).supports_vision


def refusal(call) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value.details()


def llava_inputs(llm, prompt: str, images: list) -> tuple[list[int], vllm_engine_pb2.MultimodalInputs]:
    """The prompt's expanded token ids and its images as a router preprocesses them (one batched pixel_values)."""
    import torch

    ids, features = llm.mm_processor(prompt, None, images)
    pixels = torch.cat([f.data["pixel_values"] for f in features])
    tensor = vllm_engine_pb2.TensorData(inline=pixels.numpy().tobytes(), dtype="float32", shape=pixels.shape)
    placeholders = [vllm_engine_pb2.PlaceholderRange(offset=f.mm_position.offset, length=16) for f in features]
    return ids, vllm_engine_pb2.MultimodalInputs(
        pixel_values=tensor, mm_placeholders=placeholders, batched_keys=["pixel_values"]
    )


def test_bad_images_are_refused_naming_the_item(engine, llm, media_dir):
    _, _, stub = engine
    ids, mm = llava_inputs(llm, "<5> <image> <6>", [image(1)])
    assert generate(stub, ids, mm_inputs=mm) == offline(llm, "<5> <image> <6>", [image(1)])

    def with_mm(edit):
        bad = vllm_engine_pb2.MultimodalInputs()
        bad.CopyFrom(mm)
        edit(bad)
        return lambda: generate(stub, ids, mm_inputs=bad)

    def with_refs(*urls, prompt_ids=(5, IMAGE_TOKEN)):
        return lambda: generate(stub, list(prompt_ids), media_refs=refs(*urls))

    good = data_url(png(1))
    cases = [
        # Shifted one token early: it holds 15 of the image's 16 placeholders.
        (with_mm(lambda m: setattr(m.mm_placeholders[0], "offset", 0)),
         "mm_inputs.mm_placeholders[0]: its placeholder has 15 tokens, but the image has 16 embeddings"),
        (with_mm(lambda m: m.mm_placeholders.add(offset=20, length=16)),
         "mm_inputs['pixel_values']: batched, but its first dimension is not the 2 images"),
        (with_mm(lambda m: setattr(m.pixel_values, "inline", m.pixel_values.inline[:-4])),
         "mm_inputs.pixel_values.data: 37628 bytes, but shape [1, 3, 56, 56] of float32"),
        (with_mm(lambda m: m.model_specific_tensors["aspect_ratios"].CopyFrom(m.pixel_values)),
         "mm_inputs.model_specific_tensors['aspect_ratios']: not a tensor this model takes"),
        (with_mm(lambda m: setattr(m, "modality", smg_common_pb2.VIDEO)), "mm_inputs.modality: VIDEO is not supported"),
        (with_refs(data_url(b"hello", "text/plain")), "media_refs.items[0].url: 'text/plain' is not an image type"),
        (with_refs(data_url(png(1), "image/jpeg")), "media_refs.items[0].url: 'image/jpeg', but the data is a PNG image"),
        (with_refs(data_url(png(1)[:60])), "media_refs.items[0].url: not a readable image"),
        (with_refs(good, data_url(png(2, (70, 70))), prompt_ids=(IMAGE_TOKEN, IMAGE_TOKEN)),
         "media_refs.items[1].url: 70x70 = 4900 pixels, more than max_image_pixels=3600"),
        (with_refs(good, good, good), "media_refs.items: 3 images, more than limit_mm_per_prompt=2"),
        (with_refs(good, good), "media_refs.items: the prompt holds 1 image tokens (127) for 2 images"),
        (with_refs("https://example.com/a.png"), "media_refs.items[0].url: 'https' URLs are not fetched"),
        (with_refs(f"file://{media_dir}/link.png"), "link.png' is not under --allowed-local-media-path"),  # links outside
        (with_refs("file:///etc/passwd"), "media_refs.items[0].url: '/etc/passwd' is not under --allowed-local-media-path"),
    ]  # fmt: skip
    for call, shown in cases:
        assert shown in refusal(call)
    both = lambda: generate(stub, [5, IMAGE_TOKEN], mm_inputs=mm, media_refs=refs(good))  # noqa: E731
    assert "media_refs: give the images as media_refs or as mm_inputs, not both" in refusal(both)
    # Nothing else failed: the engine still serves.
    assert generate(stub, ids, mm_inputs=mm) == offline(llm, "<5> <image> <6>", [image(1)])


def test_a_text_only_model_refuses_images(tiny_llama_dir):
    port = free_port()
    flags = ["--model", tiny_llama_dir, "--kv-cache-memory", "8MiB", "--vllm-plaintext-port", port]
    with contextlib.ExitStack() as stack:
        stack.enter_context(InProcessService("engine", [*flags, "--shutdown-timeout", "5"]))
        stub = vllm_engine_pb2_grpc.VllmEngineStub(stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{port}")))
        assert "images: the model" in refusal(lambda: generate(stub, [5, 6], media_refs=refs(data_url(png(1)))))
        assert not stub.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest()).supports_vision
        assert stub.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest()).mm_processor == ""
