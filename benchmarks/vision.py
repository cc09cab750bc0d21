"""Images: time to first token when the same images recur across requests, with the encoder cache keeping their
embeddings and without (--no-encoder-cache-keep-unused), and the vision encoder's share of a request's prefill.

    .venv/bin/python benchmarks/vision.py [--requests 16] [--images 4] [--rounds 2] [--text-layers 30]
        [--output-json PATH]

Model: a random LLaVA of a realistic small shape, written here: a CLIP ViT-B/16 tower at 224 x 224 pixels (12
layers of 768, 196 embedding tokens an image with the "default" feature strategy), the two-layer projector, and
SmolLM2-135M's language shape (30 layers of 576, 9 query and 3 KV heads), in float32. Random weights cost what
trained ones cost.

Workload: --requests requests one after the other (each alone on the engine, max_tokens 1, so its time to first
token is its queueing-free prefill), each a distinct text line, one image, and a question; the images cycle through
--images distinct ones, so each recurs. The leading line differs per request, so the prefix cache never holds an
image's blocks and only the encoder cache can spare its encoding. The requests carry their images' processed tensors
and hashes, as a front end that preprocessed them sends them (preprocessing is outside the figures).

Figures, medians over the rounds (each round runs both engines in turn): time to first token of the requests whose
image was seen before (the encoder cache's hits), of those seeing their image the first time, and over all; and, for
the requests that ran the encoder, its time (the encoder's run in the request's metrics) over the prefill time
(first scheduled to first token). The machine is shared: figures are shapes, not absolutes.
"""

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, hash_tensors
from engine.request import EngineCoreEventType, Request, SamplingParams

IMAGE_SIZE, PATCH = 224, 16
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # the class token is dropped ("default")
VOCAB = 49152
IMAGE_TOKEN = VOCAB - 1


def cpu_name() -> str:
    models = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
    return models[0] if models else platform.machine()


def write_model(path: str, text_layers: int) -> None:
    """A random LLaVA: CLIP ViT-B/16 at 224 px, SmolLM2-135M's language shape."""
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        image_size=IMAGE_SIZE, patch_size=PATCH,
    )  # fmt: skip
    text = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=576, intermediate_size=1536, num_hidden_layers=text_layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, image_seq_length=NUM_IMAGE_TOKENS,
        vision_feature_select_strategy="default", vision_feature_layer=-2,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(path)


def workload(num_requests: int, num_images: int, seed: int) -> list[tuple[list[int], MultiModalFeatureSpec, bool]]:
    """Per request: its token ids, its image, and whether that image came earlier in the sequence. Each seed draws
    images of its own, which neither engine has seen."""
    generator = torch.Generator().manual_seed(seed)
    pixels = [torch.randn(1, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator) for _ in range(num_images)]
    hashes = [hash_tensors({"pixel_values": p}) for p in pixels]
    question = [3 + (7 * i) % 500 for i in range(24)]
    requests = []
    for i in range(num_requests):
        line = [1000 + 97 * i + j for j in range(16)]  # distinct per request: no prefix-cache hit on the image
        k = i % num_images
        feature = MultiModalFeatureSpec(
            {"pixel_values": pixels[k]}, hashes[k], PlaceholderRange(len(line), NUM_IMAGE_TOKENS)
        )
        requests.append(([*line, *[IMAGE_TOKEN] * NUM_IMAGE_TOKENS, *question], feature, i >= num_images))
    return requests


def run_one(core: EngineCore, request_id: str, token_ids: list[int], feature) -> dict:
    """One request alone: its time to first token, prefill time and encoder time (0 when it hit the cache)."""
    request = Request(request_id, token_ids, SamplingParams(temperature=0, max_tokens=1), mm_features=[feature])
    arrived = time.monotonic()
    core.add_request(request)
    events, first_token = [], None
    while first_token is None:
        for out in core.step():
            events += out.events or []
            if out.new_token_ids:
                first_token = time.monotonic()
    scheduled = next(e.timestamp for e in events if e.type == EngineCoreEventType.SCHEDULED)
    starts = [e.timestamp for e in events if e.type == EngineCoreEventType.ENCODE_STARTED]
    ends = [e.timestamp for e in events if e.type == EngineCoreEventType.ENCODED]
    return {
        "ttft": first_token - arrived,
        "prefill": first_token - scheduled,
        "encoder": sum(e - s for s, e in zip(starts, ends)),
    }


def measure(core: EngineCore, requests, tag: str) -> dict:
    runs = [
        run_one(core, f"{tag}-{i}", ids, feature) | {"seen": seen} for i, (ids, feature, seen) in enumerate(requests)
    ]
    encoded = [r for r in runs if r["encoder"] > 0]
    return {
        "ttft_seen_ms": 1e3 * statistics.median(r["ttft"] for r in runs if r["seen"]),
        "ttft_first_ms": 1e3 * statistics.median(r["ttft"] for r in runs if not r["seen"]),
        "ttft_all_ms": 1e3 * statistics.median(r["ttft"] for r in runs),
        "encoded_requests": len(encoded),
        "encoder_ms": 1e3 * statistics.median(r["encoder"] for r in encoded),
        "encoder_share": statistics.median(r["encoder"] / r["prefill"] for r in encoded),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--text-layers", type=int, default=30)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        write_model(path, args.text_layers)
        engines = {
            keep: EngineCore(
                EngineArgs(model=path, dtype="float32", kv_cache_memory="512MiB", encoder_cache_keep_unused=keep)
            )  # fmt: skip
            for keep in (True, False)
        }
        for keep, core in engines.items():  # warm up: the first steps build kernels and buffers
            measure(core, workload(args.images + 1, args.images, 0), f"warm-{keep}")
        rounds = {keep: [] for keep in engines}
        for r in range(args.rounds):
            for keep, core in engines.items():
                core.reset_prefix_cache()
                rounds[keep].append(measure(core, workload(args.requests, args.images, 1 + r), f"r{r}-{keep}"))
        for core in engines.values():
            core.shutdown()
    results = {
        ("kept" if keep else "dropped"): {key: statistics.median(m[key] for m in ms) for key in ms[0]}
        for keep, ms in rounds.items()
    }
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} threads; torch {torch.__version__}")
    print(f"{args.requests} requests, {args.images} images recurring, {NUM_IMAGE_TOKENS} image tokens + 40 text tokens")
    print("encoder cache            TTFT seen image  TTFT first time  TTFT all  encoder ms  encoder share of prefill")
    for name, m in results.items():
        print(
            f"{name:<24} {m['ttft_seen_ms']:>12.1f} ms  {m['ttft_first_ms']:>12.1f} ms  {m['ttft_all_ms']:>6.1f} ms"
            f"  {m['encoder_ms']:>8.1f}    {100 * m['encoder_share']:>5.1f}% ({m['encoded_requests']:.0f} encoded)"
        )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
