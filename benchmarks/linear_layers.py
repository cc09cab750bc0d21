"""Every linear layer of a model at a few rows, timed alone, --batch-invariant on against off: where a decode step's
linear time goes in each setting (docs/determinism.md).

    .venv/bin/python benchmarks/linear_layers.py [--dtype bfloat16] [--rows 1] [--rounds 7] [any engine flag]

Each setting loads its own engine; every layer runs once on random rows of its input width, in model order, and a
round's figure is the sum over the layers. The report: the median round, and each kind of layer's median time.
"""

import argparse
import statistics
import time

import torch

from engine.config import EngineArgs
from engine.core import EngineCore


def time_layers(args: argparse.Namespace, variant: str) -> tuple[float, dict[str, float]]:
    """(ms of all linear layers a round, median ms of each kind of layer) in one --batch-invariant setting."""
    engine = EngineCore(EngineArgs.from_cli_args(argparse.Namespace(**{**vars(args), "batch_invariant": variant})))
    model = engine.worker.model_runner.model
    layers = [(name.rsplit(".", 1)[-1], m) for name, m in model.named_modules() if hasattr(m, "input_size")]
    inputs = [torch.randn(args.rows, m.input_size, dtype=engine.dtype) for _, m in layers]
    rounds, kinds = [], {}
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # the first round warms up
            total = 0.0
            for (kind, layer), x in zip(layers, inputs):
                start = time.perf_counter()
                layer.quant_method.apply(layer, x)
                took = time.perf_counter() - start
                total += took
                if r:
                    kinds.setdefault(kind, []).append(took)
            if r:
                rounds.append(total)
    return 1e3 * statistics.median(rounds), {k: 1e3 * statistics.median(t) for k, t in kinds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, conflict_handler="resolve"
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(dtype="bfloat16")
    parser.add_argument("--rows", type=int, default=1, help="rows of each layer's input (a decode step's requests)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    totals = {}
    for variant in ("on", "off"):
        totals[variant], kinds = time_layers(args, variant)
        per_kind = ", ".join(f"{k} {ms:.3f}" for k, ms in kinds.items())
        print(f"batch-invariant {variant}: all linear layers {totals[variant]:.2f} ms; each kind, ms: {per_kind}")
    print(f"on / off time: {totals['on'] / totals['off']:.2f}")


if __name__ == "__main__":
    main()
