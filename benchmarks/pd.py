"""Prefill/decode disaggregation against one engine on a mixed workload: long prompts arriving while others decode.

    .venv/bin/python benchmarks/pd.py [--decoders 4] [--decode-prompt-len 64] [--decode-len 384]
        [--long-prompts 4] [--long-prompt-len 1536] [--long-output-len 16] [--long-interval 3.0]
        [--rounds 2] [--dtype float32] [--output-json PATH]

Two meshes (services.local_mesh.Mesh, `llmmesh serve`'s processes with its KV store), one at a time so each has
the machine's cores to itself, the order alternating by round:
- P/D: one kv_producer engine computes each prompt and stores its blocks in the kvstore; one kv_consumer engine
  loads them and decodes (`llmmesh serve --prefill-engines 1 --decode-engines 1`);
- one engine doing both (`llmmesh serve`).

Each run, on new seeded prompts (token ids, greedy, ignore_eos): --decoders requests with short prompts start
together and decode --decode-len tokens; once all are decoding, --long-prompts requests of --long-prompt-len tokens
arrive --long-interval seconds apart, each asking --long-output-len tokens. Reported per run and as medians over
rounds: the decoders' ITL p50/p99 (the gaps between their token-bearing chunks, which a long prefill in the same
engine's step stretches) and TTFT p50/p99 of the long prompts and of the decoders. The two P/D engines split the
machine's cores (Mesh gives each cores / 2 threads); the one engine has them all.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import FIRST_REGULAR_ID, BenchRequest, one_request, stats_ms

from engine.config import EngineArgs
from llmmesh.v1 import gateway_pb2_grpc
from services.client import aio_gateway_channel
from services.local_mesh import Mesh

VOCAB = 49152  # SmolLM2's


async def mixed_workload(address: str, args, seed: int) -> dict:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_REGULAR_ID, VOCAB) for _ in range(n)]

    decoders = [
        BenchRequest("", args.decode_prompt_len, args.decode_len, ids(args.decode_prompt_len))
        for _ in range(args.decoders)
    ]
    longs = [
        BenchRequest("", args.long_prompt_len, args.long_output_len, ids(args.long_prompt_len))
        for _ in range(args.long_prompts)
    ]
    async with aio_gateway_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await one_request(stub, BenchRequest("", 8, 2, ids(8)), "", None)  # warm-up, untimed
        started = time.perf_counter()
        decoding = [asyncio.create_task(one_request(stub, r, "", None)) for r in decoders]
        # The long prompts start once every decoder is past its prefill (its first token takes at most this long).
        await asyncio.sleep(args.decoder_start_s)
        arriving = []
        for r in longs:
            arriving.append(asyncio.create_task(one_request(stub, r, "", None)))
            await asyncio.sleep(args.long_interval)
        decoded, long_results = await asyncio.gather(*decoding), await asyncio.gather(*arriving)
        elapsed = time.perf_counter() - started
    failed = [r.error for r in decoded + long_results if not r.ok]
    return {
        "failed": failed,
        "elapsed_s": elapsed,
        "decode_itl_ms": stats_ms([x for r in decoded if r.ok for x in r.itls]),
        "decode_ttft_ms": stats_ms([r.ttft for r in decoded if r.ok]),
        "long_ttft_ms": stats_ms([r.ttft for r in long_results if r.ok]),
    }


def run(name: str, args, seed: int) -> dict:
    engine_args = EngineArgs(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    pd = name == "P/D"
    with Mesh(engine_args, kv_store=True, prefill_engines=int(pd), num_engines=1) as mesh:
        result = asyncio.run(mixed_workload(mesh.address, args, seed))
    itl, long_ttft = result["decode_itl_ms"], result["long_ttft_ms"]
    print(
        f"{name}: decode ITL p50 {itl['p50']:.1f} ms, p99 {itl['p99']:.1f} ms; long-prompt TTFT p50 "
        f"{long_ttft['p50']:.0f} ms, p99 {long_ttft['p99']:.0f} ms; decoder TTFT p50 "
        f"{result['decode_ttft_ms']['p50']:.0f} ms; {len(result['failed'])} failed; {result['elapsed_s']:.1f} s",
        flush=True,
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--decode-len", type=int, default=384)
    ap.add_argument("--decoder-start-s", type=float, default=2.0, help="seconds from the decoders to the long prompts")
    ap.add_argument("--long-prompts", type=int, default=4)
    ap.add_argument("--long-prompt-len", type=int, default=1536)
    ap.add_argument("--long-output-len", type=int, default=16)
    ap.add_argument("--long-interval", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"machine: {machine}", flush=True)
    runs = {"P/D": [], "one engine": []}
    for r in range(args.rounds):
        order = ("P/D", "one engine") if r % 2 == 0 else ("one engine", "P/D")
        for name in order:
            runs[name].append(run(name, args, seed=r))
    report = {"machine": machine, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args)}
    report["runs"] = runs
    report["median"] = {
        name: {
            f"{metric}_{p}": statistics.median(x[metric][p] for x in results)
            for metric in ("decode_itl_ms", "decode_ttft_ms", "long_ttft_ms")
            for p in ("p50", "p99")
        }
        for name, results in runs.items()
    }
    print(json.dumps(report["median"], indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
