"""Images through the services: the tokenizer runs the model's processor on images sent as bytes or named as files
under --allowed-local-media-path, the gateway carries their tensors to the engine, and greedy output equals the
offline LLM's with the same image; bad images and limits are refused INVALID_ARGUMENT naming the item. Real gRPC
servers in this process on the tiny random LLaVA of test_vision.py."""

import contextlib
import io
import os

import grpc
import pytest
from test_vision import image, make_llm, save_tiny_llava

from conftest import InProcessService, mesh_channel
from engine.kv.hashing import extend_block_hashes, get_hash_fn, root_hash
from engine.request import SamplingParams
from llmmesh.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.routing import Router

PIL = pytest.importorskip("PIL.Image")

MAX_TOKENS = 6


def png(seed: int, size=(40, 50)) -> bytes:
    buffer = io.BytesIO()
    image(seed, size).save(buffer, format="PNG")
    return buffer.getvalue()


def image_input(data: bytes, mime: str = "image/png") -> common_pb2.ImageInput:
    return common_pb2.ImageInput(data=data, mime_type=mime)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llava")
    save_tiny_llava(path)
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "a.png").write_bytes(png(3))
    outside = tmp_path_factory.mktemp("elsewhere") / "b.png"
    outside.write_bytes(png(4))
    os.symlink(outside, root / "link.png")  # inside by name, outside once resolved
    return root


@pytest.fixture(scope="module")
def mesh(llava_dir, media_dir):
    with contextlib.ExitStack() as stack:
        services, channels = {}, {}

        def start(name, flags):
            services[name] = stack.enter_context(InProcessService(name, [*flags, "--shutdown-timeout", "5"]))
            channels[name] = stack.enter_context(mesh_channel(services[name].address))

        model = ["--model", llava_dir]
        start("engine", [*model, "--kv-cache-memory", "8MiB", "--block-size", "8"])
        start("tokenizer", [*model, "--allowed-local-media-path", media_dir, "--limit-mm-per-prompt", "2",
                            "--max-image-pixels", 60 * 60])  # fmt: skip
        start("detokenizer", model)
        text = [f for n in ("tokenizer", "detokenizer") for f in (f"--{n}", services[n].address)]
        start("gateway", ["--engine", services["engine"].address, *text])
        yield channels


@pytest.fixture(scope="module")
def llm(llava_dir):
    return make_llm(llava_dir)


def greedy() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def offline(llm, prompt: str, images: list) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [out] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params)
    return out.outputs[0].token_ids


def tokens_of(responses) -> list[int]:
    [complete] = [r.complete for r in responses if r.HasField("complete")]
    return list(complete.choices[0].token_ids)


def test_generate_with_images_matches_offline(mesh, llm):
    gateway = gateway_pb2_grpc.GatewayStub(mesh["gateway"])
    prompt = "<3> <image> <4> <image> <6>"
    request = gateway_pb2.GenerateRequest(
        text=prompt, images=[image_input(png(1)), image_input(png(2, (30, 60)))], sampling_params=greedy()
    )
    assert tokens_of(gateway.Generate(request)) == offline(llm, prompt, [image(1), image(2, (30, 60))])
    # Text alone still works on a vision-language model.
    request = gateway_pb2.GenerateRequest(text="<5> <9> <13>", sampling_params=greedy())
    assert tokens_of(gateway.Generate(request)) == offline(llm, "<5> <9> <13>", [])


def test_chat_with_image_parts_and_a_local_file_matches_offline(mesh, llm):
    gateway = gateway_pb2_grpc.GatewayStub(mesh["gateway"])
    parts = [
        common_pb2.ContentPart(text="<5>"),
        common_pb2.ContentPart(image=image_input(png(7))),
        common_pb2.ContentPart(image=common_pb2.ImageInput(path="a.png", mime_type="image/png")),
    ]
    request = gateway_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="user", content_parts=parts)], sampling_params=greedy()
    )
    # The template renders "<5> <image> <image> ", as the offline LLM.chat would.
    assert tokens_of(gateway.Chat(request)) == offline(llm, "<5> <image> <image> ", [image(7), image(3)])


def test_tokenizer_returns_tensors_ranges_and_hashes_the_router_keys_by(mesh, llm):
    tokenizer = tokenizer_pb2_grpc.TokenizerStub(mesh["tokenizer"])
    prompt = " ".join(f"<{10 + i}>" for i in range(8)) + " <image> <7>"
    reply = tokenizer.Tokenize(tokenizer_pb2.TokenizeRequest(text=prompt, images=[image_input(png(11))]))
    token_ids, [feature] = llm.mm_processor(prompt, None, [image(11)])
    assert list(reply.token_ids) == token_ids
    [mm] = reply.mm_inputs
    assert (mm.mm_position.offset, mm.mm_position.length) == (8, 16) and mm.identifier == feature.identifier
    assert mm.data["pixel_values"].dtype == "float32" and list(mm.data["pixel_values"].shape) == [1, 3, 56, 56]
    # The gateway's routing index names the prompt's blocks as the engine does: the image's hash in the blocks its
    # placeholders fall in, none in the text block before it.
    router = Router(["e"])
    router.set_model_info(engine_pb2.ModelInfo(block_size=8, enable_prefix_caching=True, prefix_caching_hash_algo="sha256"))  # fmt: skip
    hash_fn = get_hash_fn("sha256")
    engine_hashes = extend_block_hashes([], token_ids, 8, hash_fn, root_hash(hash_fn), None, mm_features=[feature])
    assert router.block_hashes(list(reply.token_ids), None, mm_features=reply.mm_inputs) == engine_hashes
    text_only = router.block_hashes(list(reply.token_ids), None)
    assert text_only[0] == engine_hashes[0] and text_only[1:] != engine_hashes[1:]


def refusal(call) -> str:
    with pytest.raises(grpc.RpcError) as e:
        list(call())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    return e.value.details()


def test_bad_images_are_refused_naming_the_item(mesh):
    gateway = gateway_pb2_grpc.GatewayStub(mesh["gateway"])

    def generate(prompt, *images):
        return lambda: gateway.Generate(
            gateway_pb2.GenerateRequest(text=prompt, images=images, sampling_params=greedy())
        )

    good = image_input(png(1))
    cases = [
        (generate("<image>", image_input(b"hello", "text/plain")), r"images[0].mime_type: 'text/plain' is not an image type"),
        (generate("<image>", image_input(png(1), "image/jpeg")), "images[0].mime_type: 'image/jpeg', but the data is a PNG image"),
        (generate("<image>", image_input(png(1)[:60])), "images[0]: not a readable image"),
        (generate("<image>", image_input(b"\x89PNG\r\n\x1a\nxx")), "images[0]: not a readable image"),
        (generate("<5> <image>", good, image_input(png(2, (70, 70)))), "images[1]: 70x70 = 4900 pixels, more than max_image_pixels=3600"),
        (generate("<image> <image> <image>", good, good, good), "images: 3 images, more than limit_mm_per_prompt=2"),
        (generate("<5> <6>", good), "images: The total number of <image> tokens"),
        (generate("<image>", common_pb2.ImageInput(path="../elsewhere/b.png", mime_type="image/png")), "images[0].path: '../elsewhere/b.png' is not under --allowed-local-media-path"),
        (generate("<image>", common_pb2.ImageInput(path="link.png", mime_type="image/png")), "images[0].path: 'link.png' is not under --allowed-local-media-path"),
        (generate("<image>", common_pb2.ImageInput(path="/etc/passwd", mime_type="image/png")), "is not under --allowed-local-media-path"),
        (generate("<image>", common_pb2.ImageInput(path="none.png", mime_type="image/png")), "images[0].path: 'none.png' is not a file"),
    ]  # fmt: skip
    for call, shown in cases:
        assert shown in refusal(call)
    parts = [common_pb2.ContentPart(text="<5>"), common_pb2.ContentPart(image=image_input(b"junk"))]
    chat = gateway_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content_parts=parts)])
    assert "messages[0].content_parts[1].image: not a readable image" in refusal(lambda: gateway.Chat(chat))
    token_ids = gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[5, 127]), images=[good])
    assert "images: a prompt with images must be text" in refusal(lambda: gateway.Generate(token_ids))
    # Nothing else failed: the mesh still answers.
    assert tokens_of(generate("<image> <5>", good)())


def test_engine_refuses_inputs_that_do_not_match_the_prompt(mesh, llm):
    engine = engine_pb2_grpc.EngineStub(mesh["engine"])
    tokenizer = tokenizer_pb2_grpc.TokenizerStub(mesh["tokenizer"])
    reply = tokenizer.Tokenize(tokenizer_pb2.TokenizeRequest(text="<5> <image> <6>", images=[image_input(png(1))]))

    def generate(mm):
        request = engine_pb2.EngineGenerateRequest(
            request_id="r", prompt_token_ids=reply.token_ids, sampling_params=greedy(), mm_inputs=[mm]
        )
        return lambda: engine.Generate(request)

    shifted = common_pb2.MultiModalInput()
    shifted.CopyFrom(reply.mm_inputs[0])
    shifted.mm_position.offset = 0
    assert "mm_inputs[0]: placeholder [0, 16) holds tokens other than image token" in refusal(generate(shifted))
    cut = common_pb2.MultiModalInput()
    cut.CopyFrom(reply.mm_inputs[0])
    cut.data["pixel_values"].data = cut.data["pixel_values"].data[:-4]
    assert "mm_inputs[0].data['pixel_values'].data: 37628 bytes, but shape [1, 3, 56, 56] of float32" in refusal(
        generate(cut)
    )
    request = engine_pb2.EngineGenerateRequest(
        request_id="r", prompt_token_ids=reply.token_ids, sampling_params=greedy(), mm_inputs=reply.mm_inputs
    )
    assert tokens_of_engine(engine.Generate(request)) == offline(llm, "<5> <image> <6>", [image(1)])


def tokens_of_engine(responses) -> list[int]:
    return [t for r in responses for o in r.outputs for t in o.token_ids]
