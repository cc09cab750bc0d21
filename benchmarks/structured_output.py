"""Structured output's cost: compiling a JSON schema (cold and cached), and the grammar bitmask per step.

    .venv/bin/python benchmarks/structured_output.py [--batch-sizes 1,32,128] [--iters 20]

On SmolLM2's tokenizer (vocabulary 49152) through the engine's StructuredOutputManager:
- compile: the tokenizer's xgrammar TokenizerInfo (once per engine), then one JSON schema compiled cold (the
  compiler's cache cleared before each) and cached (the same schema again).
- per step, for a batch of greedy requests whose matchers sit at different points of that schema's JSON: the
  bitmask fill (StructuredOutputManager.grammar_bitmask, in the scheduler), its application alone (xgrammar's
  in-place kernel on float32 logits), and the whole sampler call without and with the masks. The peer in the same
  run is that sampler call without a grammar: the ratio says what structured output adds to sampling per step.
  The wire columns: the bytes the bitmask adds to a sampler-service step against the logits' bytes (float32),
  and the time to put it in the message (grammar_bitmask_to_proto).
ms: the median of --iters calls after 3 warm-up calls, and in brackets the best call (on shared cores the
median carries the neighbours' load too).
"""

import argparse
import os
import platform
import statistics
import time
import timeit

import torch

from engine.models.files import DEFAULT_MODEL, load_config
from engine.models.loader import prepare_model_dir
from engine.request import Request, SamplingParams, StructuredOutputsParams
from engine.sample.metadata import GrammarBitmask, SamplingMetadata
from engine.sample.ops import apply_grammar_bitmask
from engine.sample.sampler import Sampler
from engine.structured_output.manager import StructuredOutputManager
from llmmesh.v1 import sampler_pb2
from mesh.sampler.wire import grammar_bitmask_to_proto

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
# A document of SCHEMA: request i's matcher has accepted its first i % len characters.
DOCUMENT = '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["maths", "engines"], '
DOCUMENT += '"address": {"street": "St James Square", "city": "London"}}'


def median_ms(fn, iters: int, setup=lambda: None) -> tuple[float, float]:
    """Median and best ms of fn() over iters calls, each after an untimed setup(), after 3 warm-up calls."""
    for _ in range(3):
        setup()
        fn()
    times = timeit.repeat(fn, setup=setup, repeat=iters, number=1)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,32,128")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    model_dir = prepare_model_dir(DEFAULT_MODEL)
    cfg = load_config(model_dir)
    manager = StructuredOutputManager(model_dir, cfg.vocab_size, cfg.eos_token_ids)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads; vocab {cfg.vocab_size}"
    )

    started = time.perf_counter()
    compiler = manager.get_compiler()
    print(f"tokenizer info (once per engine): {(time.perf_counter() - started) * 1e3:.0f} ms")
    params = StructuredOutputsParams(json=SCHEMA)
    cold_ms, cold_best = median_ms(lambda: manager.compile(params), max(3, args.iters // 4), compiler.clear_cache)
    cached_ms, cached_best = median_ms(lambda: manager.compile(params), args.iters)
    print(f"JSON schema compile: cold {cold_ms:.2f} ms (best {cold_best:.2f}), cached {cached_ms * 1e3:.1f} us "
          f"(best {cached_best * 1e3:.1f})\n")  # fmt: skip

    sampler, device = Sampler(), torch.device("cpu")
    print("| batch | bitmask fill | bitmask apply | sampler without grammar | sampler with grammar "
          "| (fill + sampler with) / sampler without | bitmask bytes / logits bytes | bitmask to the wire |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        requests = []
        for i in range(batch):
            request = Request(str(i), [1], SamplingParams(temperature=0.0, structured_outputs=params))
            manager.grammar_init(request)
            request.structured_output_request.matcher.accept_string(DOCUMENT[: (i * 7 + 5) % len(DOCUMENT)])
            requests.append(request)
        logits = torch.randn(batch, cfg.vocab_size)
        bitmask = manager.grammar_bitmask(requests)
        grammar = GrammarBitmask(list(range(batch)), bitmask)
        plain = SamplingMetadata.from_requests(requests, {}, cfg.vocab_size, device)
        masked = SamplingMetadata.from_requests(requests, {}, cfg.vocab_size, device, grammar)
        fresh = [logits]  # the sampler works in place: each call gets a fresh copy, made untimed

        def copy():
            fresh[0] = logits.clone()

        fill_ms = median_ms(lambda: manager.grammar_bitmask(requests), args.iters)
        apply_ms = median_ms(
            lambda: apply_grammar_bitmask(fresh[0], masked.grammar_bitmask, masked.grammar_rows), args.iters, copy
        )
        without_ms = median_ms(lambda: sampler(fresh[0], plain), args.iters, copy)
        with_ms = median_ms(lambda: sampler(fresh[0], masked), args.iters, copy)
        wire_ms = median_ms(lambda: grammar_bitmask_to_proto(sampler_pb2.SampleStep(), grammar), args.iters)
        ratio = (fill_ms[0] + with_ms[0]) / without_ms[0]
        cells = [f"{median:.3f} ({best:.3f})" for median, best in (fill_ms, apply_ms, without_ms, with_ms, wire_ms)]
        row = [batch, *cells[:4], f"{ratio:.2f}×", f"{bitmask.numel() / logits.numel():.3f}", cells[4]]
        print("| " + " | ".join(map(str, row)) + " |", flush=True)
    manager.shutdown()


if __name__ == "__main__":
    main()
