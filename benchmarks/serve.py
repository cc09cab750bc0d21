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
with ignore_eos, so every system does the same work; --n completions per request at --temperature sample instead
(the output token counts stay the same).

--offline runs the same requests in-process through the offline `LLM` (its own RequestMetrics for
TTFT): all at once after the mesh run, or, with --max-concurrency 1, paired: each request through
the mesh and then offline. It reports the mesh/offline throughput ratio and the median TTFT the
mesh adds. --rounds N alternates the two N times, each
round with new prompts (seed + round), and reports the median of the per-round figures. --launch
starts the mesh `llmmesh serve` runs by default on loopback first (its KV store and sampler, the gateway reaching the
services behind it over Unix sockets). --launch --tls-cost starts a second one beside it, `llmmesh serve
--insecure-plaintext`'s, and runs each round's requests through both, the plaintext one
first in every other round: it reports the TLS / plaintext output throughput ratio and the median TTFT TLS adds (run it at
--max-concurrency 1, 32 and 64 for TLS's cost by streams).

--dataset prefix_repetition (also --dataset-name, as in `vllm bench serve`): --num-prompts requests, each one of
--prefix-repetition-num-prefixes prefixes of --prefix-repetition-prefix-len tokens, then a random suffix of
--prefix-repetition-suffix-len, with max_tokens --prefix-repetition-output-len, shuffled.

--launch --engines N [N...] (N > 1) compares routing instead, on a mesh of each engine count, with the KV store
--kv-store off, on, or both (a mesh each): through a gateway for each of --routing (prefix-aware, least-loaded, and
one-engine: a gateway in front of the first engine alone), each workload on new prompts, --rounds times with the
policies' order reversed every other round. The workloads: --conversations multi-turn conversations, each turn's
prompt the whole history (a system prompt of --system-prompt-len tokens, shared by all or each its own per
--system-prompt, then each one's first message and later messages), worked through by --clients clients at once
(each its share of the conversations one after another; 0: all at once), for each --think-time (0: in lockstep;
else each turn waits a seeded random time after the last reply, so conversations fall out of step); or, with
--dataset prefix_repetition, that dataset at --request-rate and --max-concurrency. Reported per engine count, store
and workload: each policy's TTFT p50 of the turns after each conversation's first (prefix_repetition: of the
requests after the first on each prefix), pooled over the rounds and per round, the prefix cache hit rate, and
prefix-aware's TTFT p50 over least-loaded's; then one table of them all. Each gateway writes its routing decisions
(--routing-log) beside the report, under OUTPUT-routing-logs/; the report sums them up: how often the engine
chosen held the most of the prompt, the prefill queued there, and the KV events' lag; and it keeps each request's
send time, turn, TTFT and cached tokens (`turns`), which match a request to its decision in the log.
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
    repeat: bool = False  # prefix_repetition: an earlier request had its prefix
    n: int = 1  # completions of the prompt
    temperature: float = 0.0


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
    turn: int = 0  # its turn in its conversation (routing runs); prefix_repetition: 1 for a prefix's repeats
    sent: float = 0.0  # time.time() it was sent: a routing log's decision for it comes a few ms later

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
    params = common_pb2.SamplingParams(
        n=request.n, temperature=request.temperature, max_tokens=request.max_tokens, ignore_eos=True
    )
    message = gateway_pb2.GenerateRequest(model=model, text=request.prompt, sampling_params=params, stream=True)
    if request.token_ids is not None:
        message.token_ids.ids.extend(request.token_ids)
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    result = RequestResult(ok=False, prompt_len=request.prompt_len, sent=time.time())
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

    params = [
        SamplingParams(n=r.n, temperature=r.temperature, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    return [
        RequestResult(
            True,
            len(out.prompt_token_ids),
            sum(len(c.token_ids) for c in out.outputs),
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
SYSTEM_PROMPTS = ("shared", "per-conversation")


def add_routing_args(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("routing across engine replicas (--launch --engines N, N > 1)")
    group.add_argument(
        "--engines",
        type=int,
        nargs="+",
        default=[1],
        help="engine replicas; more than one runs the routing comparison instead, on a mesh of each count given "
        "(e.g. 2 4): multi-turn conversations through a gateway for each of --routing, in one run",
    )
    group.add_argument("--routing", nargs="+", choices=ROUTING_RUNS, default=list(ROUTING_RUNS))
    group.add_argument(
        "--kv-store",
        nargs="+",
        choices=("on", "off"),
        default=["off"],
        help="the mesh without the KV store, with it (redis-server and the kvstore behind every engine), or both "
        "(a mesh each)",
    )
    group.add_argument("--conversations", type=int, default=8, help="conversations in all")
    group.add_argument(
        "--clients",
        type=int,
        default=0,
        help="clients at once, each working through its share of the conversations one after another; 0: one per "
        "conversation, all at once",
    )
    group.add_argument("--turns", type=int, default=4, help="turns per conversation")
    group.add_argument(
        "--system-prompt",
        nargs="+",
        choices=SYSTEM_PROMPTS,
        default=["shared"],
        help="whether the conversations share one system prompt, or each has its own (both: a workload each)",
    )
    group.add_argument(
        "--system-prompt-len", "--shared-prefix-len", type=int, default=256, help="tokens of the system prompt"
    )
    group.add_argument("--first-turn-len", type=int, default=256, help="tokens of each conversation's first message")
    group.add_argument("--turn-len", type=int, default=32, help="tokens of each later message")
    group.add_argument("--reply-len", type=int, default=16, help="tokens of each reply")
    group.add_argument(
        "--think-time",
        type=float,
        nargs="+",
        default=[0.0],
        help="mean seconds between a reply and its conversation's next turn (exponential, seeded); 0: none, the "
        "conversations move in lockstep. Several: a workload each (e.g. 0 0.5)",
    )


def add_prefix_repetition_args(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("--dataset prefix_repetition (vllm bench serve's): --num-prompts requests")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each prefix")
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="tokens after the prefix")
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="distinct prefixes")
    group.add_argument("--prefix-repetition-output-len", type=int, default=128, help="max_tokens of each request")


def prefix_repetition_requests(args, vocab_size: int, seed: int) -> list[BenchRequest]:
    """vLLM's prefix_repetition dataset: --num-prompts requests, an equal share on each of the prefixes, each its
    prefix then a random suffix, shuffled (seeded random ids from the ordinary vocabulary). A request's `repeat`
    is whether one before it in the list had its prefix."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(n)]

    num_prefixes = max(1, args.prefix_repetition_num_prefixes)
    prefixes = [ids(args.prefix_repetition_prefix_len) for _ in range(num_prefixes)]
    chosen = [i % num_prefixes for i in range(args.num_prompts)]
    rng.shuffle(chosen)
    requests, seen = [], set()
    for p in chosen:
        tokens = prefixes[p] + ids(args.prefix_repetition_suffix_len)
        requests.append(BenchRequest("", len(tokens), args.prefix_repetition_output_len, tokens, repeat=p in seen))
        seen.add(p)
    return requests


def routing_workloads(args) -> list[dict]:
    """The workloads each mesh runs through each gateway: the prefix-repetition dataset, or conversations of each
    --system-prompt and --think-time."""
    if args.dataset == "prefix_repetition":
        return [{"name": "prefix_repetition"}]
    return [
        {
            "name": f"{system} system prompt, " + ("lockstep" if not think else f"out of step (think {think:g} s)"),
            "system_prompt": system,
            "think_time": think,
        }
        for system in args.system_prompt
        for think in args.think_time
    ]


def conversation_turns(args, vocab_size: int, seed: int, system_prompt: str = "shared") -> list[list[list[int]]]:
    """Per conversation, the new tokens of each turn: the system prompt (one for all, or each its own) and its first
    message, then later messages (seeded random ids from the ordinary vocabulary)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(n)]

    shared = ids(args.system_prompt_len)
    return [
        [(shared if system_prompt == "shared" else ids(args.system_prompt_len)) + ids(args.first_turn_len)]
        + [ids(args.turn_len) for _ in range(args.turns - 1)]
        for _ in range(args.conversations)
    ]


async def run_conversations(
    address: str, conversations, reply_len: int, model: str, think_time: float, seed: int, clients: int = 0
):
    """The conversations through `clients` clients at once (0: one each), each client working through its share
    one after another, turn after turn: each prompt is the whole history so far (greedy replies of reply_len
    tokens), sent think_time seconds on average after the last reply. The results of every turn (each its turn's
    index in .turn), and the seconds it all took."""
    rng = random.Random(seed)
    clients = clients or len(conversations)
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
                result.turn = t
                results.append(result)
                history = prompt + result.token_ids
            return results

        async def client(share) -> list[RequestResult]:
            return [r for turns in share for r in await converse(turns)]

        start = time.perf_counter()
        shares = [conversations[c::clients] for c in range(clients)]
        per_client = await asyncio.gather(*(client(share) for share in shares))
        return [r for results in per_client for r in results], time.perf_counter() - start


def run_workload(args, workload: dict, address: str, model: str, vocab_size: int, seed: int):
    """One workload through one gateway, on prompts of its own seed: its results and the seconds it took."""
    if workload["name"] == "prefix_repetition":
        requests = prefix_repetition_requests(args, vocab_size, seed)
        results, elapsed = asyncio.run(
            run_mesh(address, requests, args.request_rate, args.burstiness, args.max_concurrency, seed, model, None)
        )
        for request, result in zip(requests, results):
            result.turn = int(request.repeat)
        return results, elapsed
    conversations = conversation_turns(args, vocab_size, seed, workload["system_prompt"])
    return asyncio.run(
        run_conversations(address, conversations, args.reply_len, model, workload["think_time"], seed, args.clients)
    )


def routing_summary(path: Path, start: float, end: float) -> dict:
    """What a gateway's --routing-log says of its decisions between start and end (time.time()): how many, how often the engine chosen held the most
    of the prompt (of those some engine held a block of), the blocks queued at the engine chosen and the events'
    lag."""
    decisions = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    decisions = [d for d in decisions if start <= d["time"] <= end]
    held = [d for d in decisions if any(e["local_blocks"] for e in d["engines"].values())]
    to_holder = sum(
        d["engines"][d["engine"]]["local_blocks"] == max(e["local_blocks"] for e in d["engines"].values()) for d in held
    )
    lags = [e["event_lag_ms"] for d in decisions for e in d["engines"].values()]
    return {
        "decisions": len(decisions),
        "with_a_holder": len(held),
        "to_the_holder": to_holder,
        "prefill_blocks_queued_at_chosen_mean": statistics.fmean(
            [d["engines"][d["engine"]]["prefill_blocks"] for d in decisions]
        )
        if decisions
        else 0.0,
        "event_lag_ms_p50": statistics.median(lags) if lags else 0.0,
        "log": str(path),
    }


def run_routing(args, engine_args: EngineArgs, tokenizer: Tokenizer) -> None:
    """Each workload through a gateway per routing policy over --engines replicas, and through a gateway in front
    of the first engine alone, on a mesh of each engine count with the KV store off and on; --rounds rounds, the
    policies' order reversed every other round, new prompts each time, so no run finds another's prefixes. The
    figure: TTFT p50 of the turns after each conversation's first (with prefix_repetition: of the requests after
    the first on each prefix), per policy, pooled over the rounds."""
    from services.local_mesh import Mesh
    from services.service_process import ServiceProcess

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    workloads = routing_workloads(args)
    print(f"machine: {machine}; workloads: {', '.join(w['name'] for w in workloads)}")
    gateway_args = ["--served-model-name", engine_args.model, "--log-level", "WARNING"]
    gateway_args += ["--max-requests-in-flight", str(max(1024, args.num_prompts))]
    logs = Path(args.output_json).with_suffix("")
    logs = logs.parent / f"{logs.name}-routing-logs"
    logs.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": {k: v for k, v in vars(args).items() if k != "api_key"},
        "shapes": [],
    }
    runs = list(args.routing)
    for num_engines in args.engines:
        for store in args.kv_store:
            results = {(w["name"], run): [] for w in workloads for run in runs}
            per_round = {(w["name"], run): [] for w in workloads for run in runs}
            seconds = {(w["name"], run): 0.0 for w in workloads for run in runs}
            decisions = {(w["name"], run): [] for w in workloads for run in runs}
            print(f"\n{num_engines} engines, KV store {store}")
            with Mesh(engine_args, gateway_args, num_engines=num_engines, kv_store=store == "on") as mesh:
                backends = ["--tokenizer", mesh.services["tokenizer"].address]
                backends += ["--detokenizer", mesh.services["detokenizer"].address]
                for r in range(args.rounds):
                    for run in runs if r % 2 == 0 else runs[::-1]:
                        log = logs / f"{num_engines}-engines-store-{store}-{run}-round-{r + 1}.jsonl"
                        log.unlink(missing_ok=True)
                        flags = [*gateway_args, "--routing-log", str(log)]
                        if run == "one-engine":
                            engine = ["--engine", mesh.services["engine"].address]
                            gateway = ServiceProcess("gateway", ["--port", "0", *flags, *engine, *backends])
                            gateway.wait_listening(60)
                        else:
                            gateway = mesh.start_gateway([*flags, "--routing", run])
                        try:
                            for w, workload in enumerate(workloads):
                                seed = args.seed + 1000 * r + 100 * ROUTING_RUNS.index(run) + w
                                start = time.time()
                                got, elapsed = run_workload(
                                    args, workload, gateway.address, engine_args.model, tokenizer.vocab_size, seed
                                )
                                results[workload["name"], run] += got
                                seconds[workload["name"], run] += elapsed
                                decisions[workload["name"], run].append(routing_summary(log, start, time.time()))
                                later = [x.ttft for x in got if x.ok and x.turn > 0]
                                per_round[workload["name"], run].append(statistics.median(later) if later else None)
                        finally:
                            gateway.stop()
            for workload in workloads:
                shape = {"engines": num_engines, "kv_store": store, "workload": workload["name"], "runs": {}}
                print(f"\n{num_engines} engines, KV store {store}, {workload['name']}")
                for run in runs:
                    got = results[workload["name"], run]
                    ok = [x for x in got if x.ok]
                    summary = summarize(got, seconds[workload["name"], run], {})
                    summary.pop("requests")
                    summary["ttft_later_turns_ms"] = stats_ms([x.ttft for x in ok if x.turn > 0])
                    summary["ttft_later_turns_p50_per_round_ms"] = [
                        None if v is None else v * 1e3 for v in per_round[workload["name"], run]
                    ]
                    summary["prefix_cache_hit_rate"] = sum(x.cached_tokens for x in ok) / max(
                        1, sum(x.prompt_len for x in ok)
                    )
                    summary["routing_decisions"] = decisions[workload["name"], run]
                    # Each request, to be matched with its decision in the routing log by the time it was sent.
                    summary["turns"] = [
                        {"sent": x.sent, "turn": x.turn, "ttft_ms": x.ttft * 1e3, "cached_tokens": x.cached_tokens}
                        for x in ok
                    ]
                    shape["runs"][run] = summary
                    later = summary["ttft_later_turns_ms"]
                    print(
                        f"  {run:>12}: TTFT p50 later turns {later.get('p50', float('nan')):.1f} ms, "
                        f"all turns {summary['ttft_ms'].get('p50', float('nan')):.1f} ms, "
                        f"hit rate {summary['prefix_cache_hit_rate']:.1%}, {summary['failed']} failed"
                    )
                    for d in decisions[workload["name"], run]:
                        print(
                            f"  {'':>12}  {d['decisions']} decisions, {d['to_the_holder']} of {d['with_a_holder']} "
                            f"with a holder to it; mean prefill blocks queued at the chosen engine "
                            f"{d['prefill_blocks_queued_at_chosen_mean']:.1f}; event lag p50 {d['event_lag_ms_p50']:.1f} ms"
                        )
                pa, ll = shape["runs"].get("prefix-aware"), shape["runs"].get("least-loaded")
                if pa and ll and pa["ttft_later_turns_ms"] and ll["ttft_later_turns_ms"]:
                    ratio = pa["ttft_later_turns_ms"]["p50"] / ll["ttft_later_turns_ms"]["p50"]
                    shape["prefix_aware_over_least_loaded_ttft_p50"] = ratio
                    print(f"  prefix-aware / least-loaded TTFT p50 (later turns): {ratio:.2f}x")
                report["shapes"].append(shape)
    print("\n| engines | KV store | workload | " + " | ".join(runs) + " | prefix-aware / least-loaded |")
    print("| ---: | --- | --- | " + " | ".join("---:" for _ in runs) + " | ---: |")
    for shape in report["shapes"]:
        cells = [f"{shape['runs'][run]['ttft_later_turns_ms'].get('p50', float('nan')):.0f}" for run in runs]
        ratio = shape.get("prefix_aware_over_least_loaded_ttft_p50")
        print(
            f"| {shape['engines']} | {shape['kv_store']} | {shape['workload']} | {' | '.join(cells)} | "
            + (f"{ratio:.2f}x |" if ratio is not None else "- |")
        )
    write_report(args.output_json, report)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = ap.add_mutually_exclusive_group(required=True)
    target.add_argument("--address", help="a running gateway's HOST:PORT")
    target.add_argument("--launch", action="store_true", help="start the mesh on loopback for the run")
    ap.add_argument(
        "--dataset",
        "--dataset-name",
        default="synthetic",
        help="'synthetic', 'prefix_repetition' (vllm bench serve's: --prefix-repetition-*) or a ShareGPT-format JSON "
        "file",
    )
    ap.add_argument("--num-prompts", type=int, default=64, help="requests in a round")
    ap.add_argument(
        "--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"), help="synthetic prompt tokens"
    )
    ap.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"), help="synthetic max_tokens"
    )
    ap.add_argument("--n", type=int, default=1, help="completions per request")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
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
    add_prefix_repetition_args(ap)
    EngineArgs.add_cli_args(ap)
    args = ap.parse_args()
    goodput = parse_goodput(args.goodput)
    engine_args = EngineArgs.from_cli_args(args)
    tokenizer = Tokenizer.from_pretrained(prepare_model_dir(engine_args.model))
    if max(args.engines) > 1:
        if not args.launch:
            raise SystemExit("--engines N (N > 1) starts its own mesh: give --launch")
        if min(args.engines) < 2:
            raise SystemExit(f"--engines: the routing comparison runs on 2 engines or more, got {args.engines}")
        return run_routing(args, engine_args, tokenizer)
    if args.kv_store != ["off"]:
        raise SystemExit("--kv-store is an option of the routing comparison (--engines N, N > 1)")

    def make_requests(seed: int) -> list[BenchRequest]:
        if args.dataset == "synthetic":
            requests = synthetic_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, seed)
        elif args.dataset == "prefix_repetition":
            requests = prefix_repetition_requests(args, tokenizer.vocab_size, seed)
        else:
            requests = sharegpt_requests(tokenizer, args.dataset, args.num_prompts, seed)
        for r in requests:
            r.n, r.temperature = args.n, args.temperature
        return requests

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
        mesh = serve_mesh(engine_args, args.num_prompts)
        address = mesh.start()
        print(f"mesh up, gateway at {address}")
        if args.tls_cost:
            plain_mesh = serve_mesh(engine_args, args.num_prompts, "--insecure-plaintext")
            print(f"plaintext mesh up, gateway at {plain_mesh.start()}")
    model = engine_args.model if args.launch else ""

    def run_through(gateway: str, requests, api_key, plaintext: bool | None = None):
        return asyncio.run(
            run_mesh(
                gateway,
                requests,
                args.request_rate,
                args.burstiness,
                args.max_concurrency,
                args.seed,
                model,
                api_key,
                plaintext=plaintext,
            )
        )

    def run_plain(requests):
        return run_through(plain_mesh.address, requests, None, plaintext=True)

    try:
        for i in range(args.rounds):
            # New prompts each round, so neither side's prefix cache holds them from an earlier one.
            requests = make_requests(args.seed + i)
            entry = {}
            # The plaintext mesh goes first in every other round: whichever runs second finds the cores warmer.
            plain = run_plain(requests) if plain_mesh is not None and i % 2 else None
            if llm is not None and one_at_a_time:
                (mesh_results, mesh_s), (offline_out, offline_s) = asyncio.run(
                    run_paired(address, llm, requests, model, args.api_key)
                )
            else:
                mesh_results, mesh_s = run_through(address, requests, args.api_key)
                if llm is not None:
                    offline_out, offline_s = run_offline(llm, requests)
            entry["mesh"] = summarize(mesh_results, mesh_s, goodput)
            print_table(f"round {i + 1}: mesh (through the gateway)", entry["mesh"])
            if plain_mesh is not None:
                if plain is None:
                    plain = run_plain(requests)
                plain_results, plain_s = plain
                entry["plaintext"] = summarize(plain_results, plain_s, goodput)
                print_table(f"round {i + 1}: the plaintext mesh", entry["plaintext"])
                secure, plaintext = entry["mesh"], entry["plaintext"]
                entry["tls_over_plaintext"] = {
                    "output_throughput_ratio": secure["output_token_throughput"] / plaintext["output_token_throughput"],
                    "median_ttft_added_ms": secure["ttft_ms"]["p50"] - plaintext["ttft_ms"]["p50"],
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


def serve_mesh(engine_args: EngineArgs, num_prompts: int, *flags: str):
    """The mesh `llmmesh serve` runs by default (its KV store and sampler, the gateway's links over Unix sockets),
    with these engine arguments and FLAGS, not yet started."""
    from services.cli import build_parser
    from services.local_mesh import engine_flags
    from services.supervisor import serve_mesh

    argv = ["serve", "--port", "0", *engine_flags(engine_args), *flags]
    argv += ["--max-requests-in-flight", str(max(1024, num_prompts)), "--served-model-name", engine_args.model]
    return serve_mesh(build_parser().parse_args(argv), echo=False)


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
