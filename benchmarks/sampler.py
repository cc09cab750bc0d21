"""Sampler microbenchmark on CPU: cost of one call, and of building its SamplingMetadata.

    .venv/bin/python benchmarks/sampler.py [--batch-sizes 1,64,256] [--vocab 49152] [--iters 20] [--threads N]
        [--dtype float32|bfloat16] [--logits random|model] [--scenarios greedy,random,mixed,top-p]

Scenarios (logits [batch, vocab] in --dtype; bfloat16 is what a bfloat16 model hands the sampler):
  greedy  default SamplingParams with temperature=0: the argmax path.
  random  default SamplingParams (temperature 1): softmax and one draw a row, nothing else.
  mixed   rows cycle through four kinds: penalties (repetition 1.1, frequency 0.5, presence 0.3,
          temperature 0.8) over a 100-token prompt and 100-token output; top_k=50 with top_p=0.9;
          logprobs=5, greedy; seed with top_p=0.95 (its own torch.Generator).
  top-p   every row top_p=0.95 at temperature 1, nothing else (the nucleus alone).
Logits: random normal (the default: flat rows, every token about as likely, the worst case for top-p), or the
model's (SmolLM2's next-token logits at each position of a few texts, computed once by transformers from the
embedded checkpoint: how peaked a real model's rows are; --vocab is then the model's).
Timed: from_requests alone ("build"), Sampler.__call__ on prebuilt metadata ("sample"), and both
back to back ("build+sample"). Medians and p90 over --iters calls after --warmup calls.
"""

import argparse
import os
import platform
import statistics
import time

import torch

from engine.request import Request, SamplingParams
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import Sampler


def make_batch(scenario: str, batch_size: int, vocab: int, rng: torch.Generator):
    def history(n):
        return torch.randint(vocab, (n,), generator=rng).tolist()

    requests, generators = [], {}
    for row in range(batch_size):
        prompt, output = history(100), history(100)
        if scenario == "greedy":
            params = SamplingParams(temperature=0.0)
        elif scenario == "random":
            params = SamplingParams()
        elif scenario == "top-p":
            params = SamplingParams(top_p=0.95)
        else:
            kind = row % 4
            params = [
                SamplingParams(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3, temperature=0.8),
                SamplingParams(top_k=50, top_p=0.9),
                SamplingParams(logprobs=5, temperature=0.0),
                SamplingParams(seed=row, top_p=0.95),
            ][kind]
            if params.seed is not None:
                generators[row] = torch.Generator().manual_seed(params.seed)
        request = Request(str(row), prompt, params, eos_token_ids=(0,))
        for token in output:
            request.append_output_token_ids(token)
        requests.append(request)
    return requests, generators


TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a screw press. Within decades, printers across Europe produced books, pamphlets "
    "and broadsheets, and the price of a book fell so far that ordinary merchants could own a small library.",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n",
    "Dear team, thank you all for the work on last quarter's release. Before we plan the next one, I would like "
    "each of you to write down one thing that slowed you down and one thing you would keep exactly as it was.",
    "A refrigerator moves heat from its inside to the room: a compressor squeezes the refrigerant, which gives off "
    "heat in the coils at the back, then expands through a valve and evaporates inside, absorbing heat as it does.",
]


def model_logits(rows: int) -> torch.Tensor:
    """SmolLM2's next-token logits at the positions of TEXTS, cycled to rows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config import DEFAULT_MODEL
    from engine.models.files import resolve_model

    gguf = resolve_model(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with torch.inference_mode():
        found = torch.cat([model(**tokenizer(text, return_tensors="pt")).logits[0] for text in TEXTS])
    return found[torch.arange(rows) % len(found)]


def timed(fn, iters: int, warmup: int, setup=lambda: None) -> list[float]:
    """ms per call of fn(setup()), setup untimed."""
    times = []
    for i in range(warmup + iters):
        arg = setup()
        start = time.perf_counter()
        fn(arg)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def summary(times: list[float]) -> str:
    times = sorted(times)
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    return f"{statistics.median(times):.3f} / {p90:.3f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the logits' dtype")
    ap.add_argument("--logits", choices=["random", "model"], default="random")
    ap.add_argument("--scenarios", default="greedy,random,mixed,top-p")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device("cpu")
    sampler = Sampler()
    rng = torch.Generator().manual_seed(0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    found = model_logits(max(batch_sizes)) if args.logits == "model" else None
    if found is not None:
        args.vocab = found.size(1)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads"
    )
    print(f"vocab {args.vocab}, {args.logits} {args.dtype} logits, {args.iters} iterations after {args.warmup} warm-up")
    print("ms per call as median / p90\n")
    print("| scenario | batch | build (ms) | sample (ms) | build+sample (ms) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for scenario in args.scenarios.split(","):
        for batch_size in batch_sizes:
            requests, generators = make_batch(scenario, batch_size, args.vocab, rng)
            logits = found[:batch_size] if found is not None else torch.randn(batch_size, args.vocab, generator=rng)
            logits = logits.to(getattr(torch, args.dtype))
            # The sampler works in place on float32 logits: each call gets a fresh copy, made untimed.
            fresh = logits.clone

            def build(_=None):
                return SamplingMetadata.from_requests(requests, generators, args.vocab, device)

            md = build()
            build_ms = timed(build, args.iters, args.warmup)
            sample_ms = timed(lambda x: sampler(x, md), args.iters, args.warmup, fresh)
            both_ms = timed(lambda x: sampler(x, build()), args.iters, args.warmup, fresh)
            row = [scenario, str(batch_size), summary(build_ms), summary(sample_ms), summary(both_ms)]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
