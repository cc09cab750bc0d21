"""Where a decode step's time goes in the engine: the layers' products, attention, the rest of the forward pass, the
LM head, and the step's work outside the model.

    .venv/bin/python benchmarks/step_split.py [--dtypes float32 bfloat16] [--batch-size 1] [--rounds 5]
        [--steps 30] [--output-json PATH] [any engine flag: --model, --kv-cache-memory, ...]

One engine per --dtypes entry, in this process, each decoding --batch-size requests of 256 random prompt tokens (EOS
ignored). Each round runs --steps decode steps on every engine in turn, the order reversed every other round, and
keeps each figure's median over its steps; the report is the median over the rounds. Each step is timed whole
(EngineCore.step) and in parts, by timers around: every linear layer's quant method (the products; the LM head's
counted apart), the attention backend's forward (the cache write and attention, every layer), the model's forward
and its compute_logits. The rest of the forward is the forward less its products and attention: the norms, RoPE,
activation and residual kernels, and the Python and torch dispatch between them.
"""

import argparse
import json
import random
import statistics
import time

from engine.config import EngineArgs
from engine.core import EngineCore
from engine.request import Request, SamplingParams

PARTS = ("step", "layer products", "attention", "rest of the forward", "LM head", "outside the model")


class StepTimer:
    """Seconds spent in each timed call of one engine since the last reset()."""

    def __init__(self, engine: EngineCore):
        self.seconds: dict[str, float] = {}
        model = engine.worker.model_runner.model
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and not getattr(method, "timed", False):
                method.apply, method.timed = self.wrap("products", method.apply), True
        model.forward = self.wrap("forward", model.forward)
        model.compute_logits = self.wrap("logits", model.compute_logits)
        backend = model.attn_backend
        backend.forward = self.wrap("attention", backend.forward)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

        return timed

    def reset(self) -> None:
        self.seconds.clear()


def split(step_s: float, seconds: dict[str, float]) -> dict[str, float]:
    """One step's parts in ms (PARTS), from its whole time and its timers."""
    get = seconds.get
    layer_products = get("products", 0.0) - get("logits", 0.0)  # the LM head's product is in compute_logits
    parts = {
        "step": step_s,
        "layer products": layer_products,
        "attention": get("attention", 0.0),
        "rest of the forward": get("forward", 0.0) - layer_products - get("attention", 0.0),
        "LM head": get("logits", 0.0),
        "outside the model": step_s - get("forward", 0.0) - get("logits", 0.0),
    }
    return {name: value * 1e3 for name, value in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="decode steps a round and engine")
    parser.add_argument("--output-json", help="write the results here too")
    args = parser.parse_args()
    engines, timers = {}, {}
    for dtype in args.dtypes:
        engine = EngineCore(EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "dtype": dtype})))
        rng = random.Random(dtype)
        vocab = engine.model_config.vocab_size
        for i in range(args.batch_size):
            prompt = [rng.randrange(17, vocab) for _ in range(256)]
            params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
            engine.add_request(Request(f"{dtype}-{i}", prompt, params))
        for _ in range(5):  # the prefill and the first decodes
            engine.step()
        engines[dtype], timers[dtype] = engine, StepTimer(engine)
    rounds = {dtype: [] for dtype in args.dtypes}
    for r in range(args.rounds):
        for dtype in args.dtypes if r % 2 == 0 else reversed(args.dtypes):
            steps = []
            for _ in range(args.steps):
                timers[dtype].reset()
                started = time.perf_counter()
                engines[dtype].step()
                steps.append(split(time.perf_counter() - started, timers[dtype].seconds))
            rounds[dtype].append({name: statistics.median(s[name] for s in steps) for name in PARTS})
            print(f"round {r + 1} {dtype}: " + ", ".join(f"{n} {rounds[dtype][-1][n]:.2f}" for n in PARTS), flush=True)
    report = {dtype: {name: [round(row[name], 2) for row in rows] for name in PARTS} for dtype, rows in rounds.items()}
    print(f"\nmedians over {args.rounds} rounds, ms a decode step at batch {args.batch_size}:")
    print("part".ljust(22) + "".join(d.rjust(12) for d in args.dtypes))
    for name in PARTS:
        print(name.ljust(22) + "".join(f"{statistics.median(report[d][name]):12.2f}" for d in args.dtypes))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"batch_size": args.batch_size, "rounds": report}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
