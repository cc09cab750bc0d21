"""Online serving benchmark through the gateway, like `vllm bench serve`.

    .venv/bin/python benchmarks/serve.py --address HOST:PORT | --launch
        [--dataset synthetic|PATH.json] [--num-prompts 64] [--input-len 32 512] [--output-len 16 256]
        [--request-rate inf] [--burstiness 1.0] [--max-concurrency 32] [--seed 0]
        [--goodput ttft:MS tpot:MS] [--offline] [--output-json PATH] [engine flags with --launch]

Requests arrive at --request-rate per second (inf: all at once) with gamma-distributed gaps
(shape --burstiness; 1 is Poisson), at most --max-concurrency in flight. Each streams from the
gateway's Generate; the client stamps every chunk that carries tokens. Reported (mean, p50, p90,
p99): TTFT (first token), ITL (gap between token-bearing chunks), TPOT ((e2e - ttft) / (tokens - 1))
and end-to-end latency; request, output and total token throughput; goodput (requests per second
meeting every --goodput SLO). The --output-json report also keeps each request's TTFT and ITLs
(`requests` of each run), which benchmarks/plots.py draws as distributions.

Datasets: `synthetic` (seeded: random token ids from the ordinary vocabulary, decoded to text, with
lengths uniform in --input-len; max_tokens uniform in --output-len), or a ShareGPT-format JSON file
(the first human turn is the prompt, the reply's token count is max_tokens). Generation is greedy
with ignore_eos, so every system does the same work.

--offline runs the same requests in-process through the offline `LLM` (its own RequestMetrics for
TTFT): all at once after the mesh run, or, with --max-concurrency 1, paired: each request through
the mesh and then offline. It reports the mesh/offline throughput ratio and the median TTFT the
mesh adds. --rounds N alternates the two N times, each
round with new prompts (seed + round), and reports the median of the per-round figures. --launch
starts the whole mesh (`llmmesh serve`'s processes) on loopback first. --launch --tls-cost starts a second mesh
beside it, in plaintext (--insecure-plaintext), and runs each round's requests through both, the mutual-TLS one
first: it reports the TLS / plaintext output throughput ratio and the median TTFT TLS adds (run it at
--max-concurrency 1, 32 and 64 for TLS's cost by streams).

--launch --engines N (N > 1) compares routing instead: --conversations multi-turn conversations at once, each
turn's prompt the whole history (a prefix of --shared-prefix-len tokens shared by all, then each one's own first
message and later messages), through a gateway for each of --routing (prefix-aware, least-loaded, and one-engine:
a gateway in front of the first engine alone), each on new prompts, in one run; with --think-time, each turn waits
a seeded random time after the last reply, so conversations fall out of step. Reported per run: the table above
and the prefix cache hit rate (cached / prompt tokens); then prefix-aware's TTFT p50 over least-loaded's.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from engine.config import EngineArgs
from engine.models.loader import prepare_model_dir
from engine.text.tokenizer import Tokenizer
from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.client import aio_gateway_channel

FIRST_REGULAR_ID = 17  # SmolLM2's special tokens are ids 0..16


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    max_tokens: int
    token_ids: list[int] | None = None  # sent as token ids rather than the text


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    token_ids: list[int] = field(default_factory=list)  # the reply
    cached_tokens: int = 0  # prompt tokens the engine found cached

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def synthetic_requests(tokenizer: Tokenizer, n, input_len, output_len, seed) -> list[BenchRequest]:
    rng = random.Random(seed)
    requests = []
    for _ in range(n):
        ids = [rng.randrange(FIRST_REGULAR_ID, tokenizer.vocab_size) for _ in range(rng.randint(*input_len))]
        text = tokenizer.decode(ids)
        # Re-encoding decoded random ids gives a prompt of about the same length; count the real one.
        requests.append(BenchRequest(text, len(tokenizer.encode(text)), rng.randint(*output_len)))
    return requests


def sharegpt_requests(tokenizer: Tokenizer, path: str, n, seed) -> list[BenchRequest]:
    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    rng.shuffle(data)
    requests = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        prompt_len, output_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue  # vLLM's filter for ShareGPT
        requests.append(BenchRequest(prompt, prompt_len, output_len))
        if len(requests) == n:
            break
    return requests


async def arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield request indices at gamma-distributed gaps (mean 1/rate)."""
    rng = random.Random(seed + 1)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def one_request(stub, request: BenchRequest, model: str, api_key: str | None) -> RequestResult:
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
    message = gateway_pb2.GenerateRequest(model=model, text=request.prompt, sampling_params=params, stream=True)
    if request.token_ids is not None:
        message.token_ids.ids.extend(request.token_ids)
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    result = RequestResult(ok=False, prompt_len=request.prompt_len)
    start = last = time.perf_counter()
    try:
        async for response in stub.Generate(message, metadata=metadata):
            now = time.perf_counter()
            if response.HasField("chunk"):
                n = sum(len(c.token_ids) for c in response.chunk.choices)
                if n == 0:
                    continue
                if result.output_tokens == 0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                result.output_tokens += n
                result.token_ids += [t for c in response.chunk.choices for t in c.token_ids]
                last = now
            else:
                result.output_tokens = response.complete.usage.completion_tokens
                result.prompt_len = response.complete.usage.prompt_tokens
                result.cached_tokens = response.complete.usage.cached_tokens
        result.e2e = time.perf_counter() - start
        result.ok = True
    except grpc.aio.AioRpcError as e:
        result.error = f"{e.code().name}: {e.details()}"
    return result


async def run_mesh(address, requests, rate, burstiness, max_concurrency, seed, model, api_key, plaintext=None):
    limit = asyncio.Semaphore(max_concurrency)
    async with aio_gateway_channel(address, insecure_plaintext=plaintext) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def limited(request):
            async with limit:
                return await one_request(stub, request, model, api_key)

        # One warm-up request, untimed.
        await one_request(stub, BenchRequest("Hello", 2, 2), model, api_key)
        start = time.perf_counter()
        tasks = []
        async for i in arrivals(len(requests), rate, burstiness, seed):
            tasks.append(asyncio.create_task(limited(requests[i])))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def load_offline(engine_args: EngineArgs):
    from engine import LLM, SamplingParams

    llm = LLM(**vars(engine_args))
    llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    return llm


def offline_results(llm, requests: list[BenchRequest]) -> list[RequestResult]:
    """The requests in one generate() call; TTFT and E2E from the engine's own RequestMetrics."""
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    return [
        RequestResult(
            True,
            len(out.prompt_token_ids),
            len(out.outputs[0].token_ids),
            out.metrics.time_to_first_token,
            out.metrics.e2e_latency,
        )
        for out in outputs
    ]


def run_offline(llm, requests: list[BenchRequest]):
    start = time.perf_counter()
    results = offline_results(llm, requests)
    return results, time.perf_counter() - start


async def run_paired(address, llm, requests, model, api_key):
    """One request at a time, each through the mesh and then offline, so the machine's drifts hit both."""
    async with aio_gateway_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await one_request(stub, BenchRequest("Hello", 2, 2), model, api_key)  # warm-up, untimed
        mesh, offline = [], []
        for request in requests:
            mesh.append(await one_request(stub, request, model, api_key))
            offline += offline_results(llm, [request])
    return (mesh, sum(r.e2e for r in mesh)), (offline, sum(r.e2e for r in offline))


def stats_ms(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(v * 1e3 for v in values)

    def pct(p):
        return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]

    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], elapsed: float, goodput: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)

    def meets(r):
        tpot = r.tpot or 0.0
        return r.ttft * 1e3 <= goodput.get("ttft", float("inf")) and tpot * 1e3 <= goodput.get("tpot", float("inf"))

    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": elapsed,
        "request_throughput": len(ok) / elapsed,
        "output_token_throughput": out_tokens / elapsed,
        "total_token_throughput": (in_tokens + out_tokens) / elapsed,
        "goodput": sum(1 for r in ok if meets(r)) / elapsed if goodput else None,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itls]),
        "e2e_ms": stats_ms([r.e2e for r in ok]),
        "requests": [{"ttft_ms": round(r.ttft * 1e3, 2), "itl_ms": [round(x * 1e3, 2) for x in r.itls]} for r in ok],
    }


def print_table(name: str, s: dict) -> None:
    print(f"\n{name}: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.1f} s")
    for error in s["errors"]:
        print(f"  error: {error}")
    print(
        f"  requests/s {s['request_throughput']:.2f}   output tok/s {s['output_token_throughput']:.1f}   "
        f"total tok/s {s['total_token_throughput']:.1f}"
        + (f"   goodput {s['goodput']:.2f} req/s" if s["goodput"] is not None else "")
    )
    print("  | metric (ms) | mean | p50 | p90 | p99 |")
    print("  | --- | ---: | ---: | ---: | ---: |")
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[metric]
        if v:
            print(f"  | {metric[:-3].upper()} | {v['mean']:.1f} | {v['p50']:.1f} | {v['p90']:.1f} | {v['p99']:.1f} |")


def parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot") or not value:
            raise SystemExit(f"--goodput takes ttft:MS and/or tpot:MS, got {item!r}")
        slos[name] = float(value)
    return slos


# ---- routing across engine replicas: multi-turn conversations that share a prefix ----------------------------

ROUTING_RUNS = ("prefix-aware", "least-loaded", "one-engine")


def add_routing_args(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("routing across engine replicas (--launch --engines N, N > 1)")
    group.add_argument(
        "--engines",
        type=int,
        default=1,
        help="engine replicas; more than one runs the routing comparison instead: multi-turn conversations through "
        "a gateway for each of --routing, each on new prompts, in one run",
    )
    group.add_argument("--routing", nargs="+", choices=ROUTING_RUNS, default=list(ROUTING_RUNS))
    group.add_argument("--conversations", type=int, default=8, help="conversations at once")
    group.add_argument("--turns", type=int, default=4, help="turns per conversation")
    group.add_argument(
        "--shared-prefix-len", type=int, default=256, help="tokens of the prompt all conversations share"
    )
    group.add_argument("--first-turn-len", type=int, default=256, help="tokens of each conversation's first message")
    group.add_argument("--turn-len", type=int, default=32, help="tokens of each later message")
    group.add_argument("--reply-len", type=int, default=16, help="tokens of each reply")
    group.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="mean seconds between a reply and its conversation's next turn (exponential, seeded); 0: none, the "
        "conversations move in step",
    )


def conversation_turns(args, vocab_size: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, the new tokens of each turn: the shared prefix and its own first message, then later
    messages (seeded random ids from the ordinary vocabulary)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(n)]

    shared = ids(args.shared_prefix_len)
    return [
        [shared + ids(args.first_turn_len)] + [ids(args.turn_len) for _ in range(args.turns - 1)]
        for _ in range(args.conversations)
    ]


async def run_conversations(address: str, conversations, reply_len: int, model: str, think_time: float, seed: int):
    """All conversations at once, each turn after turn: each prompt is the whole history so far (greedy replies of
    reply_len tokens), sent think_time seconds on average after the last reply. The results of every turn, and the
    seconds it all took."""
    rng = random.Random(seed)
    async with aio_gateway_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await one_request(stub, BenchRequest("Hello", 2, 2), model, None)  # warm-up, untimed

        async def converse(turns) -> list[RequestResult]:
            history, results = [], []
            for t, new in enumerate(turns):
                if t and think_time > 0:
                    await asyncio.sleep(rng.expovariate(1 / think_time))
                prompt = history + new
                result = await one_request(stub, BenchRequest("", len(prompt), reply_len, prompt), model, None)
                results.append(result)
                history = prompt + result.token_ids
            return results

        start = time.perf_counter()
        per_conversation = await asyncio.gather(*(converse(turns) for turns in conversations))
        return [r for results in per_conversation for r in results], time.perf_counter() - start


def run_routing(args, engine_args: EngineArgs, tokenizer: Tokenizer) -> None:
    """The same kind of workload through a gateway per routing policy over --engines replicas, and through a
    gateway in front of the first engine alone; new prompts for each, so no run finds another's prefixes."""
    from services.local_mesh import Mesh
    from services.service_process import ServiceProcess

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"machine: {machine}; {args.conversations} conversations of {args.turns} turns at once")
    gateway_args = ["--served-model-name", engine_args.model, "--log-level", "WARNING"]
    report = {
        "machine": machine,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "runs": {},
    }
    with Mesh(engine_args, gateway_args, num_engines=args.engines) as mesh:
        backends = ["--tokenizer", mesh.services["tokenizer"].address]
        backends += ["--detokenizer", mesh.services["detokenizer"].address]
        for i, run in enumerate(args.routing):
            if run == "one-engine":
                gateway = ServiceProcess(
                    "gateway", ["--port", "0", *gateway_args, "--engine", mesh.services["engine"].address, *backends]
                )
                gateway.wait_listening(60)
            else:
                gateway = mesh.start_gateway([*gateway_args, "--routing", run])
            try:
                conversations = conversation_turns(args, tokenizer.vocab_size, args.seed + i)
                results, elapsed = asyncio.run(
                    run_conversations(
                        gateway.address, conversations, args.reply_len, engine_args.model, args.think_time, args.seed
                    )
                )
            finally:
                gateway.stop()
            summary = summarize(results, elapsed, {})
            ok = [r for r in results if r.ok]
            summary["prefix_cache_hit_rate"] = sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_len for r in ok))
            report["runs"][run] = summary
            print_table(f"{run} ({args.engines if run != 'one-engine' else 1} engines)", summary)
            print(f"  prefix cache hit rate {summary['prefix_cache_hit_rate']:.1%}")
    runs = report["runs"]
    if "prefix-aware" in runs and "least-loaded" in runs:
        ratio = runs["prefix-aware"]["ttft_ms"]["p50"] / runs["least-loaded"]["ttft_ms"]["p50"]
        report["prefix_aware_over_least_loaded_ttft_p50"] = ratio
        print(f"\nprefix-aware / least-loaded TTFT p50: {ratio:.2f}x")
    write_report(args.output_json, report)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--address", help="a running gateway's HOST:PORT")
    target.add_argument("--launch", action="store_true", help="start the mesh on loopback for the run")
    ap.add_argument("--dataset", default="synthetic", help="'synthetic' or a ShareGPT-format JSON file")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests in a round")
    ap.add_argument(
        "--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"), help="synthetic prompt tokens"
    )
    ap.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"), help="synthetic max_tokens"
    )
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second; inf: all at once")
    ap.add_argument("--burstiness", type=float, default=1.0, help="the arrival gaps' gamma shape; 1: Poisson")
    ap.add_argument("--max-concurrency", type=int, default=32, help="requests in flight at most")
    ap.add_argument("--goodput", nargs="*", help="SLOs, e.g. ttft:2000 tpot:500 (ms)")
    ap.add_argument("--offline", action="store_true", help="also run the same requests in-process and compare")
    ap.add_argument("--rounds", type=int, default=1, help="alternate mesh and offline runs this many times")
    ap.add_argument("--api-key", default=None, help="the gateway's --api-key, with --address")
    ap.add_argument(
        "--tls-cost", action="store_true", help="with --launch: the same rounds through a plaintext mesh too"
    )
    ap.add_argument(
        "--output-json",
        default="benchmarks/results/serve.json",
        help="the report: every figure and each request's TTFT and ITLs",
    )
    add_routing_args(ap)
    EngineArgs.add_cli_args(ap)
    args = ap.parse_args()
    goodput = parse_goodput(args.goodput)
    engine_args = EngineArgs.from_cli_args(args)
    tokenizer = Tokenizer.from_pretrained(prepare_model_dir(engine_args.model))
    if args.engines > 1:
        if not args.launch:
            raise SystemExit("--engines N (N > 1) starts its own mesh: give --launch")
        return run_routing(args, engine_args, tokenizer)

    def make_requests(seed: int) -> list[BenchRequest]:
        if args.dataset == "synthetic":
            return synthetic_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, seed)
        return sharegpt_requests(tokenizer, args.dataset, args.num_prompts, seed)

    requests = make_requests(args.seed)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"machine: {machine}, Python {platform.python_version()}")
    print(
        f"workload: {len(requests)} requests, {sum(r.prompt_len for r in requests)} prompt tokens, "
        f"{sum(r.max_tokens for r in requests)} output tokens; rate {args.request_rate}, "
        f"burstiness {args.burstiness}, max concurrency {args.max_concurrency}"
    )

    report = {
        "machine": machine,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "rounds": [],
    }
    one_at_a_time = args.max_concurrency == 1
    if (
        args.offline
        and not one_at_a_time
        and (args.request_rate != float("inf") or args.max_concurrency < len(requests))
    ):
        print(
            "\nnote: the offline run admits every request at once; compare with --request-rate inf "
            "and --max-concurrency >= --num-prompts (or --max-concurrency 1)"
        )
    # Loaded before the mesh starts and kept between rounds, so mesh and offline rounds alternate
    # on a warm machine and share its slow drifts.
    if args.tls_cost and (args.offline or not args.launch):
        raise SystemExit("--tls-cost needs --launch, and not --offline")
    llm = load_offline(engine_args) if args.offline else None
    mesh = plain_mesh = None
    address = args.address
    if args.launch:
        from services.local_mesh import Mesh

        gateway_args = [
            "--max-requests-in-flight",
            str(max(1024, args.num_prompts)),
            "--served-model-name",
            engine_args.model,
        ]
        mesh = Mesh(engine_args, gateway_args)
        address = mesh.start()
        print(f"mesh up, gateway at {address}")
        if args.tls_cost:
            plain_mesh = Mesh(engine_args, gateway_args, insecure_plaintext=True)
            print(f"plaintext mesh up, gateway at {plain_mesh.start()}")
    model = engine_args.model if args.launch else ""
    try:
        for i in range(args.rounds):
            # New prompts each round, so neither side's prefix cache holds them from an earlier one.
            requests = make_requests(args.seed + i)
            entry = {}
            if llm is not None and one_at_a_time:
                (mesh_results, mesh_s), (offline_out, offline_s) = asyncio.run(
                    run_paired(address, llm, requests, model, args.api_key)
                )
            else:
                mesh_results, mesh_s = asyncio.run(
                    run_mesh(
                        address,
                        requests,
                        args.request_rate,
                        args.burstiness,
                        args.max_concurrency,
                        args.seed,
                        model,
                        args.api_key,
                    )
                )
                if llm is not None:
                    offline_out, offline_s = run_offline(llm, requests)
            entry["mesh"] = summarize(mesh_results, mesh_s, goodput)
            print_table(f"round {i + 1}: mesh (through the gateway)", entry["mesh"])
            if plain_mesh is not None:
                plain_results, plain_s = asyncio.run(
                    run_mesh(
                        plain_mesh.address,
                        requests,
                        args.request_rate,
                        args.burstiness,
                        args.max_concurrency,
                        args.seed,
                        model,
                        None,
                        plaintext=True,
                    )
                )
                entry["plaintext"] = summarize(plain_results, plain_s, goodput)
                print_table(f"round {i + 1}: the plaintext mesh", entry["plaintext"])
                secure, plain = entry["mesh"], entry["plaintext"]
                entry["tls_over_plaintext"] = {
                    "output_throughput_ratio": secure["output_token_throughput"] / plain["output_token_throughput"],
                    "median_ttft_added_ms": secure["ttft_ms"]["p50"] - plain["ttft_ms"]["p50"],
                }
            if llm is not None:
                entry["offline"] = summarize(offline_out, offline_s, goodput)
                print_table(f"round {i + 1}: offline LLM.generate (in-process)", entry["offline"])
                ratio = entry["mesh"]["output_token_throughput"] / entry["offline"]["output_token_throughput"]
                added = entry["mesh"]["ttft_ms"]["p50"] - entry["offline"]["ttft_ms"]["p50"]
                entry["mesh_over_offline"] = {"output_throughput_ratio": ratio, "median_ttft_added_ms": added}
                print(
                    f"\nround {i + 1}: mesh / offline output tok/s {ratio:.3f}x; "
                    f"median TTFT added by the mesh {added:.1f} ms"
                )
                if one_at_a_time:  # the same request's two TTFTs, taken seconds apart
                    paired = statistics.median(m.ttft - o.ttft for m, o in zip(mesh_results, offline_out)) * 1e3
                    entry["mesh_over_offline"]["paired_ttft_added_ms_p50"] = paired
                    print(f"round {i + 1}: median over requests of (mesh TTFT - offline TTFT) {paired:.1f} ms")
            report["rounds"].append(entry)
    finally:
        for m in (mesh, plain_mesh):
            if m is not None:
                m.stop()
    if llm is not None:
        print(f"\n{median_over_rounds(report, 'mesh_over_offline', 'mesh / offline', 'the mesh')}")
    if plain_mesh is not None:
        print(f"\n{median_over_rounds(report, 'tls_over_plaintext', 'TLS / plaintext', 'TLS')}")
    write_report(args.output_json, report)


def median_over_rounds(report: dict, key: str, ratio_name: str, adder: str) -> str:
    """Sets report["median_over_rounds"] from each round's report[key] (output_throughput_ratio,
    median_ttft_added_ms); returns the line that says it."""
    ratios = [r[key]["output_throughput_ratio"] for r in report["rounds"]]
    added = [r[key]["median_ttft_added_ms"] for r in report["rounds"]]
    report["median_over_rounds"] = {
        "output_throughput_ratio": statistics.median(ratios),
        "median_ttft_added_ms": statistics.median(added),
    }
    return (
        f"over {len(ratios)} rounds: {ratio_name} output tok/s {statistics.median(ratios):.3f}x "
        f"(each: {', '.join(f'{r:.3f}' for r in ratios)}); median TTFT added by {adder} "
        f"{statistics.median(added):.1f} ms (each: {', '.join(f'{a:.1f}' for a in added)})"
    )


def write_report(path: str, report: dict) -> None:
    text = json.dumps(report, indent=2, default=str)
    # A list of numbers (a request's ITLs) on one line, so a report with every request's stays short.
    text = re.sub(r"\[[-\d.,\s]+\]", lambda m: json.dumps(json.loads(m.group())), text)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
