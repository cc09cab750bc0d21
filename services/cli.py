"""The `llmmesh` command: every service, the mesh supervisor, the client commands and the offline demo."""

import argparse
import os
import sys
import time

# The sampler shares its host's cores with the engine: its OpenMP threads sleep between steps instead of spinning,
# which would take a core from the engine's next forward pass. OpenMP reads the policy once, when torch loads, so
# it is set before anything loads torch.
if sys.argv[1:2] == ["sampler"]:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The engine's threads spin 100,000 times after a parallel region, not libgomp's default 300,000, so that a sampler
# on the same host gets a core sooner while it samples; far fewer would slow the forward pass itself.
if sys.argv[1:2] == ["engine"]:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

from engine.config.utils import add_cli_args
from services import (
    certs,
    client,
    config,
    detokenizer_service,
    gateway,
    kvstore_service,
    server,
    supervisor,
    tokenizer_service,
)
from services.settings import DemoConfig, EngineFlags, LocalMediaConfig, OfflineFlags, SamplerFlags, WatchdogConfig
from services.supervisor import DEMO_CHAT, DEMO_PROMPTS


def run_offline(args: argparse.Namespace) -> None:
    """Generate from a few prompts through the offline LLM API and print them."""
    from engine import LLM, SamplingParams
    from engine.config import EngineArgs

    config.setup_logging()
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


def run_engine(args: argparse.Namespace) -> None:
    from services import engine_service  # torch loads here, in the engine process only

    config.run(engine_service.serve(args), args)


def run_sampler(args: argparse.Namespace) -> None:
    from services import sampler_service  # torch loads here too: only the engine and the sampler compute

    config.run(sampler_service.serve(args), args)


def build_parser() -> argparse.ArgumentParser:
    from engine.config import EngineArgs

    parser = argparse.ArgumentParser(prog="llmmesh", description="llmmesh: an LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    offline = sub.add_parser("run-offline", help="generate from a few prompts with the offline engine")
    add_cli_args(offline, OfflineFlags, grouped=False)
    EngineArgs.add_cli_args(offline)
    add_cli_args(offline, DemoConfig)
    offline.set_defaults(func=run_offline)
    engine = config.service_parser(
        sub, "engine", "serve an EngineCore over gRPC (llmmesh.v1.Engine and vllm.grpc.engine.VllmEngine)"
    )
    EngineArgs.add_cli_args(engine)
    add_cli_args(engine, EngineFlags, grouped=False)
    add_cli_args(engine, LocalMediaConfig)
    add_cli_args(engine, WatchdogConfig)
    config.add_limit_args(engine)
    config.add_detailed_traces_arg(engine)
    engine.set_defaults(func=run_engine)
    for module in (server, tokenizer_service, detokenizer_service, kvstore_service):
        module.add_subcommands(sub)
    sampler = config.service_parser(sub, "sampler", "serve llmmesh.v1.Sampler (one step's logits -> sampled ids)")
    add_cli_args(sampler, SamplerFlags, grouped=False)
    # An engine's stream lasts as long as the engine: a drain would wait for it to its end.
    sampler.set_defaults(func=run_sampler, shutdown_timeout=1.0)
    for module in (gateway, supervisor, client, certs):
        module.add_subcommands(sub)
    config.apply_env(parser)
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
