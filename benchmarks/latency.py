"""Latency of one batch at a time, like `vllm bench latency`: prefill and decode tokens/s per batch size.

    .venv/bin/python benchmarks/latency.py [--batch-size 1,16,64] [--input-len 256] [--output-len 128]
        [--num-iters 1] [--output-json PATH] [any engine flag: --dtype, --quantization, --model, ...]

Each run: --batch-size requests at once, each --input-len random token ids (seeded by --seed) and exactly
--output-len greedy tokens (EOS ignored), the shape of llama.cpp's llama-batched-bench (-npp, -ntg, -npl).
Prefill tokens/s: batch * input_len over the time until every request has its first token. Decode tokens/s:
batch * (output_len - 1) over the time from then to the last token. One warm-up run per batch size first.
"""

import argparse
import json
import platform
import random
import time

import torch

from engine.config import EngineArgs, parse_int_list
from engine.core import EngineCore
from engine.request import Request, SamplingParams

FIRST_REGULAR_ID = 17  # SmolLM2's special tokens are ids 0..16


def run_batch(engine, batch: int, input_len: int, output_len: int, rng: random.Random) -> tuple[float, float]:
    """(prefill s, decode s) of one batch driven step by step."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    waiting = set()
    for _ in range(batch):
        request_id = f"r{rng.getrandbits(64)}"
        waiting.add(request_id)
        engine.add_request(
            Request(request_id, [rng.randrange(FIRST_REGULAR_ID, vocab) for _ in range(input_len)], params)
        )
    started, prefilled = time.perf_counter(), None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                waiting.discard(out.request_id)
        if prefilled is None and not waiting:
            prefilled = time.perf_counter()
    return prefilled - started, time.perf_counter() - prefilled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=parse_int_list, default=[1, 16, 64], help="batch sizes, e.g. 1,16,64")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--num-iters", type=int, default=1, help="timed runs per batch size (the best is kept)")
    parser.add_argument("--output-json", help="write the results here too")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args()
    engine_args = EngineArgs.from_cli_args(args)
    longest = max(args.batch_size)
    engine_args.max_num_seqs = max(engine_args.max_num_seqs, longest)
    engine = EngineCore(engine_args)
    rng = random.Random(engine_args.seed)
    rows = []
    for batch in args.batch_size:
        run_batch(engine, batch, min(args.input_len, 16), 4, rng)  # warm-up
        runs = [run_batch(engine, batch, args.input_len, args.output_len, rng) for _ in range(args.num_iters)]
        prefill_s, decode_s = min(r[0] for r in runs), min(r[1] for r in runs)
        rows.append(
            {
                "batch_size": batch,
                "prefill_tok_s": batch * args.input_len / prefill_s,
                "decode_tok_s": batch * (args.output_len - 1) / decode_s if args.output_len > 1 else None,
                "decode_step_ms": 1e3 * decode_s / max(args.output_len - 1, 1),
            }
        )
        print(
            f"batch {batch:4d}: prefill {rows[-1]['prefill_tok_s']:9.1f} tok/s, decode {rows[-1]['decode_tok_s']:8.1f}"
            f" tok/s ({rows[-1]['decode_step_ms']:.2f} ms/step)",
            flush=True,
        )
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "engine": {"model": engine_args.model, "dtype": str(engine.dtype), "quantization": engine_args.quantization},
        "shape": {"input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters},
        "results": rows,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
