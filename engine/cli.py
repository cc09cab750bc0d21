"""The `llmmesh` command."""

import argparse
import importlib
import sys
import time

# Modules that add their own subcommands: each has add_subcommands(subparsers), and every parser it
# adds sets `func` (called with the parsed args) through set_defaults.
SERVICE_MODULES: tuple[str, ...] = (
    "services.grpc_server",
    "services.tokenizer_service", "services.detokenizer_service", "services.engine_service", "services.gateway", "services.mesh",
)

DEMO_PROMPTS = [
    "The capital of France is",
    "def quicksort(items):",
    "Three facts about the Moon:",
]
DEMO_CHAT = [{"role": "user", "content": "Write a haiku about paged memory."}]


def run_offline(args: argparse.Namespace) -> None:
    """Generate from a few prompts through the offline LLM API and print them."""
    from engine import LLM, SamplingParams
    from engine.config import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    start = time.perf_counter()
    llm = LLM(**vars(engine_args))
    print(f"Loaded {engine_args.model} in {time.perf_counter() - start:.1f} s")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.sampling_seed)
    prompts = args.prompt or DEMO_PROMPTS
    outputs = llm.generate(prompts, params)
    if not args.prompt:
        outputs += llm.chat(DEMO_CHAT, params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        print("-" * 72)
        print(f"prompt: {out.prompt!r}")
        print(f"output: {completion.text!r}")
        print(f"        {len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}")


def build_parser() -> argparse.ArgumentParser:
    from engine.config import EngineArgs

    parser = argparse.ArgumentParser(prog="llmmesh", description="llmmesh: an LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    offline = sub.add_parser("run-offline", help="generate from a few prompts with the offline engine")
    offline.add_argument("--prompt", action="append", help="a prompt (repeatable); default: built-in demos")
    offline.add_argument("--max-tokens", type=int, default=48)
    offline.add_argument("--temperature", type=float, default=0.0)
    offline.add_argument("--sampling-seed", type=int, default=None)
    EngineArgs.add_cli_args(offline)
    offline.set_defaults(func=run_offline)
    for module in SERVICE_MODULES:
        importlib.import_module(module).add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:  # bad flags or input: a clear message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
