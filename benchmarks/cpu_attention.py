"""CPU attention microbenchmark at SmolLM2-135M's shape: one engine step's attention, backend against backend.

    .venv/bin/python benchmarks/cpu_attention.py [--backends torch,cpu] [--scenario decode] [--rounds 7]

A step is what the model does per step: prepare() once, then forward() (reshape_and_cache + attention) for
each of 30 layers, float32, 9 query heads / 3 KV heads / head_dim 64, block_size 16, with each request's
blocks scattered at random over the cache. Scenarios (seeded):
  decode   64 requests, one query token each, context uniform in 100..700.
  prefill  4 whole prompts of 256 tokens.
  chunk    4 prompt chunks of 128 tokens after 256 cached tokens (a chunked prefill or a prefix hit).
  mixed    the decode batch plus one 128-token chunk after 256 cached tokens.
  hit      one request's 16 new tokens after 2,048 cached ones (a long prefix hit's first step).
  long     one whole prompt of 2,048 tokens (a long prompt's first token).
Backends run alternately, round after round (the machine is shared and noisy); medians are printed.
"""

import argparse
import random
import statistics
import time

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.selector import get_attn_backend

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16


def make_step(scenario: str, seed: int = 0):
    """(query lengths, seq_lens) of the batch, decodes first."""
    rng = random.Random(seed)
    decodes = [(1, rng.randint(100, 700)) for _ in range(64)]
    return {
        "decode": decodes,
        "prefill": [(256, 256)] * 4,
        "chunk": [(128, 384)] * 4,
        "mixed": decodes + [(128, 384)],
        "hit": [(16, 2064)],
        "long": [(2048, 2048)],
    }[scenario]


def make_inputs(rows, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(s // -BLOCK) for _, s in rows]
    num_blocks = sum(blocks_per_req) + 8
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(rows), max(blocks_per_req), dtype=torch.long)
    used, slots, starts = 0, [], [0]
    for i, ((q, s), nb) in enumerate(zip(rows, blocks_per_req)):
        table[i, :nb] = perm[used : used + nb]
        used += nb
        pos = torch.arange(s - q, s)
        slots.append(table[i, pos // BLOCK] * BLOCK + pos % BLOCK)
        starts.append(starts[-1] + q)
    n = starts[-1]
    metadata = AttentionMetadata(
        num_actual_tokens=n,
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor([s for _, s in rows]),
        block_table=table,
        num_decodes=sum(1 for q, _ in rows if q == 1),
        query_start_loc_cpu=starts,
        seq_lens_cpu=[s for _, s in rows],
    )
    caches = [
        tuple(torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
        for _ in range(LAYERS)
    ]
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return (
        metadata,
        caches,
        q.reshape(n, HEADS, HEAD_DIM),
        k.reshape(n, KV_HEADS, HEAD_DIM),
        v.view(n, KV_HEADS, HEAD_DIM),
    )


@torch.inference_mode()
def time_step(backend, metadata, caches, q, k, v) -> float:
    start = time.perf_counter()
    backend.prepare(metadata)
    for cache in caches:
        backend.forward(q, k, v, cache, metadata, HEAD_DIM**-0.5)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="torch,cpu")
    parser.add_argument("--scenario", default="decode", choices=["decode", "prefill", "chunk", "mixed", "hit", "long"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps timed per backend per round (median kept)")
    args = parser.parse_args()

    inputs = make_inputs(make_step(args.scenario), getattr(torch, args.dtype))
    backends = {name: get_attn_backend(name, BLOCK, "cpu") for name in args.backends.split(",")}
    for backend in backends.values():
        time_step(backend, *inputs)  # warm-up
    times = {name: [] for name in backends}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            times[name].append(statistics.median(time_step(backend, *inputs) for _ in range(args.steps)))
    print(f"{args.scenario} {args.dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds:")
    for name, t in times.items():
        print(
            f"  {name:6s} median {statistics.median(t) * 1e3:8.2f} ms/step   rounds: "
            + " ".join(f"{x * 1e3:.1f}" for x in t)
        )


if __name__ == "__main__":
    main()
