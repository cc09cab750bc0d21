"""Tensor parallelism and determinism on the embedded SmolLM2: greedy tokens of N prompts on an engine of
--tensor-parallel-size SIZE against one of a single rank, in each dtype; and, on the SIZE engine, each prompt alone
against all of them in one batch (batch invariance within the size). SmolLM2-135M's 9 heads and 3 KV heads divide by
3, not by 2.

    flock /tmp/bench.lock .venv/bin/python benchmarks/tp_determinism.py [--size 3] [--tokens 32] [--batch-invariant on]

Prints one JSON line per dtype: how many prompts' tokens differ, and where the first difference falls."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.models.files import DEFAULT_MODEL, load_tokenizer
from engine.models.loader import prepare_model_dir
from engine.request import Request, SamplingParams

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    "To make a cup of tea, first",
    "import numpy as np\n\ndef normalize(v):\n    ",
    "The largest planet in the solar system is",
    "In 1969, the first humans to walk on the moon were",
    "A good way to learn a new language is",
    "SELECT name, age FROM users WHERE",
    "The chemical symbol for gold is",
    "My favourite season is autumn because",
    "The theory of relativity was developed by",
    "Here is a short poem about the ocean:\n",
    "The quick brown fox",
]


def run(engine: EngineCore, prompts: list[list[int]], tokens: int, together: bool) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    batches = [list(enumerate(prompts))] if together else [[(i, p)] for i, p in enumerate(prompts)]
    out = {}
    for batch in batches:
        for i, prompt in batch:
            # A salt of its own: no request reads another's cached blocks.
            engine.add_request(Request(f"{together}-{i}", prompt, params, cache_salt=f"{together}-{i}"))
            out[i] = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[int(o.request_id.split("-")[1])] += o.new_token_ids
    return [out[i] for i in range(len(prompts))]


def compare(ours: list[list[int]], reference: list[list[int]]) -> dict:
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, reference)]
    positions = [f for f in first if f is not None]
    return {"differ": len(positions), "of": len(ours), "first_difference_at": sorted(positions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batch-invariant", default="on", choices=("on", "off"))
    args = parser.parse_args()
    model = prepare_model_dir(DEFAULT_MODEL)
    tokenizer = load_tokenizer(model)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    for dtype in args.dtypes.split(","):
        outputs = {}
        for size in (1, args.size):
            engine = EngineCore(
                EngineArgs(
                    model=str(model), dtype=dtype, tensor_parallel_size=size, batch_invariant=args.batch_invariant
                )
            )
            try:
                outputs[size] = run(engine, prompts, args.tokens, together=True)
                if size > 1:
                    outputs["alone"] = run(engine, prompts, args.tokens, together=False)
            finally:
                engine.shutdown()
        result = {
            "dtype": dtype,
            "batch_invariant": args.batch_invariant,
            "tokens": args.tokens,
            f"tp{args.size}_vs_tp1": compare(outputs[args.size], outputs[1]),
            f"tp{args.size}_batch_vs_alone": compare(outputs[args.size], outputs["alone"]),
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
