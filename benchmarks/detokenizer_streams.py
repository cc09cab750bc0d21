"""Detokenizer stream layouts: one bidi stream per request, or one stream multiplexing every request's step.

Models the gateway during decode: each engine step yields one new token for each of N requests, and the
gateway needs every one's text delta before it can stream them on. Per step it either
  (a) writes one item to each request's own stream and waits for the N replies, or
  (b) writes one batch of N items to a single shared stream and waits for the one reply batch.
The step latency is from the first write of a step to the last reply of that step. In-process
RequestDetokenizer (no gRPC) is measured alongside as the floor.

    python benchmarks/detokenizer_streams.py                  # starts a detokenizer process on a free port
    python benchmarks/detokenizer_streams.py --address HOST:PORT --requests 32 --tokens 64 --repeats 5
"""

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import grpc

from engine.models.loader import DEFAULT_MODEL, prepare_model_dir
from engine.request import SamplingParams
from engine.text import RequestDetokenizer, Tokenizer
from llmmesh.v1 import detokenizer_pb2 as pb
from llmmesh.v1 import detokenizer_pb2_grpc
from mesh import tls
from services.certs import make_credentials
from services.service_process import ServiceProcess

TEXTS = [
    "The quick brown fox jumps over the lazy dog while the cat watches from the window sill. ",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "你好，世界！日本語のテキストと한국어 텍스트가 섞여 있습니다。",
    "Family 👨‍👩‍👧 and flags 🇫🇷🇯🇵, thumbs 👍🏽 up 🎉 for the release party! ",
    "Paged attention splits the KV cache into fixed-size blocks, so memory is allocated on demand. ",
]
PROMPT = "Please continue the text:\n"
STOP = ["\n\n\n", "###"]  # present in start messages so hold-back runs, never hit by the texts


def make_workload(tok: Tokenizer, num_requests: int, num_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    outputs = []
    for _ in range(num_requests):
        text = "".join(rng.choice(TEXTS) for _ in range(8))
        ids = tok.encode(text)
        while len(ids) < num_tokens:
            ids += ids
        outputs.append(ids[:num_tokens])
    return outputs


def start_item(rid: str, prompt_ids: list[int]) -> pb.DetokenizeItem:
    return pb.DetokenizeItem(request_id=rid, start=pb.DetokenizeStart(prompt_token_ids=prompt_ids, stop=STOP))


def step_item(rid: str, token_id: int, last: bool) -> pb.DetokenizeItem:
    return pb.DetokenizeItem(request_id=rid, step=pb.DetokenizeStep(token_ids=[token_id], finished=last))


def check(texts: dict[str, str], outputs: list[list[int]], tok: Tokenizer) -> None:
    for i, ids in enumerate(outputs):
        assert texts[f"r{i}"] == tok.decode(ids), f"request {i}: wrong text"


async def per_request_streams(stub, prompt_ids, outputs) -> tuple[list[float], dict[str, str]]:
    calls = [stub.Detokenize() for _ in outputs]
    texts = {f"r{i}": "" for i in range(len(outputs))}

    async def exchange(call, item):
        await call.write(pb.DetokenizeBatch(items=[item]))
        return (await call.read()).results[0]

    await asyncio.gather(*(exchange(c, start_item(f"r{i}", prompt_ids)) for i, c in enumerate(calls)))
    latencies = []
    num_steps = len(outputs[0])
    for s in range(num_steps):
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(exchange(c, step_item(f"r{i}", outputs[i][s], s == num_steps - 1)) for i, c in enumerate(calls))
        )
        latencies.append(time.perf_counter() - t0)
        for r in results:
            texts[r.request_id] += r.text
    for c in calls:
        await c.done_writing()
        assert await c.read() == grpc.aio.EOF
    return latencies, texts


async def multiplexed_stream(stub, prompt_ids, outputs) -> tuple[list[float], dict[str, str]]:
    call = stub.Detokenize()
    texts = {f"r{i}": "" for i in range(len(outputs))}
    await call.write(pb.DetokenizeBatch(items=[start_item(f"r{i}", prompt_ids) for i in range(len(outputs))]))
    await call.read()
    latencies = []
    num_steps = len(outputs[0])
    for s in range(num_steps):
        t0 = time.perf_counter()
        await call.write(
            pb.DetokenizeBatch(items=[step_item(f"r{i}", ids[s], s == num_steps - 1) for i, ids in enumerate(outputs)])
        )
        reply = await call.read()
        latencies.append(time.perf_counter() - t0)
        for r in reply.results:
            texts[r.request_id] += r.text
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    return latencies, texts


def in_process(tok, prompt_ids, outputs) -> tuple[list[float], dict[str, str]]:
    params = SamplingParams(max_tokens=None, stop=STOP)
    detoks = [RequestDetokenizer(tok, prompt_ids, params) for _ in outputs]
    texts = {f"r{i}": "" for i in range(len(outputs))}
    latencies = []
    num_steps = len(outputs[0])
    for s in range(num_steps):
        t0 = time.perf_counter()
        for i, d in enumerate(detoks):
            d.update([outputs[i][s]], False)
            texts[f"r{i}"] += d.get_next_output_text(s == num_steps - 1, delta=True)
        latencies.append(time.perf_counter() - t0)
    return latencies, texts


def summary(latencies: list[float], num_tokens: int) -> dict:
    return {
        "tokens_per_s": num_tokens / sum(latencies),
        "step_ms_p50": 1e3 * statistics.median(latencies),
        "step_ms_p90": 1e3 * statistics.quantiles(latencies, n=10)[-1],
    }


async def run(args, tok: Tokenizer) -> dict:
    outputs = make_workload(tok, args.requests, args.tokens, args.seed)
    prompt_ids = tok.encode(PROMPT)
    total = args.requests * args.tokens
    runs = {"in_process": [], "per_request_streams": [], "multiplexed_stream": []}
    async with tls.aio_channel(args.address, "detokenizer", tls.credentials_from_env("gateway")) as channel:
        stub = detokenizer_pb2_grpc.DetokenizerStub(channel)
        await multiplexed_stream(stub, prompt_ids, outputs)  # warm up both paths
        await per_request_streams(stub, prompt_ids, outputs)
        for _ in range(args.repeats):  # interleaved, so machine noise hits every layout alike
            for name, fn in (("per_request_streams", per_request_streams), ("multiplexed_stream", multiplexed_stream)):
                latencies, texts = await fn(stub, prompt_ids, outputs)
                check(texts, outputs, tok)
                runs[name].append(summary(latencies, total))
            latencies, texts = in_process(tok, prompt_ids, outputs)
            check(texts, outputs, tok)
            runs["in_process"].append(summary(latencies, total))
    # Each figure's median over the runs.
    return {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="a running detokenizer; default: start one on a free port")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json")
    args = parser.parse_args()
    tok = Tokenizer.from_pretrained(prepare_model_dir(args.model))
    detokenizer = None
    if args.address is None:  # a process of its own, so the server does not share this client's GIL
        if not tls.plaintext_from_env():
            make_credentials(tls.default_tls_dir())  # as `llmmesh serve` does on first start
        detokenizer = ServiceProcess("detokenizer", ["--port", "0", "--model", args.model])
        args.address = detokenizer.wait_listening(300)
    try:
        results = asyncio.run(run(args, tok))
    finally:
        if detokenizer is not None:
            detokenizer.stop(30)
    print(
        f"{args.requests} requests x {args.tokens} tokens, one token per request per step, "
        f"median of {args.repeats} runs"
    )
    print(f"{'layout':<22}{'tokens/s':>12}{'step p50 ms':>14}{'step p90 ms':>14}")
    for name, r in results.items():
        print(f"{name:<22}{r['tokens_per_s']:>12.0f}{r['step_ms_p50']:>14.3f}{r['step_ms_p90']:>14.3f}")
    ratio = results["multiplexed_stream"]["tokens_per_s"] / results["per_request_streams"]["tokens_per_s"]
    print(f"multiplexed / per-request throughput: {ratio:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"config": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
