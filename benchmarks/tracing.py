"""What tracing costs: the same workload through a mesh that traces every request and through one that does not.

    .venv/bin/python benchmarks/tracing.py [--num-prompts 64] [--max-concurrency 32] [--rounds 3]
        [--input-len 32 256] [--output-len 64 128] [--collect-detailed-traces] [--output-json PATH] [engine flags]

Two meshes (`llmmesh serve`'s processes, services.local_mesh.Mesh) start on loopback: one with every service
exporting spans (--otlp-traces-endpoint, --trace-sample-ratio 1) to an OTLP/gRPC sink in this process (a real
grpc server taking TraceService/Export; it counts the bytes and spans' requests without decoding them, as a
collector on another machine would cost this one nothing), and one with tracing off, as by default. Rounds
alternate between them (the order flips each round, so slow drifts of the machine fall on both), each round
with new prompts; benchmarks/serve.py drives the requests (greedy, ignore_eos, streamed). Reported per round
and as the median over rounds: output token throughput traced / untraced, and the median TTFT tracing adds.
"""

import argparse
import asyncio
import os
import platform
import sys
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import median_over_rounds, print_table, run_mesh, summarize, synthetic_requests, write_report

from engine.config import EngineArgs
from engine.models.loader import prepare_model_dir
from engine.text.tokenizer import Tokenizer
from services.local_mesh import Mesh


class OtlpSink:
    """opentelemetry.proto.collector.trace.v1.TraceService/Export on a free port: accepts and counts, decodes nothing."""

    def __init__(self):
        self.exports = self.bytes = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(2))

        def export(request: bytes, context) -> bytes:
            self.exports += 1
            self.bytes += len(request)
            return b""  # an empty ExportTraceServiceResponse

        handler = grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {
                "Export": grpc.unary_unary_rpc_method_handler(export),  # no (de)serializers: raw bytes
            },
        )
        self.server.add_generic_rpc_handlers([handler])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def start_mesh(engine_args: EngineArgs, env: dict, num_prompts: int) -> Mesh:
    mesh = Mesh(
        engine_args,
        ["--max-requests-in-flight", str(max(1024, num_prompts)), "--served-model-name", engine_args.model],
        env=env,
    )
    mesh.start()
    return mesh


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(64, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--collect-detailed-traces", action="store_true", help="the traced mesh's engine adds step spans")
    ap.add_argument("--output-json", default="benchmarks/results/tracing.json")
    EngineArgs.add_cli_args(ap)
    args = ap.parse_args()
    engine_args = EngineArgs.from_cli_args(args)
    tokenizer = Tokenizer.from_pretrained(prepare_model_dir(engine_args.model))
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )

    sink = OtlpSink()
    traced_env = {"LLMMESH_OTLP_TRACES_ENDPOINT": f"127.0.0.1:{sink.port}", "LLMMESH_TRACE_SAMPLE_RATIO": "1.0"}
    if args.collect_detailed_traces:
        traced_env["LLMMESH_COLLECT_DETAILED_TRACES"] = "all"
    untraced_env = {"LLMMESH_OTLP_TRACES_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}
    meshes = {}
    report = {"args": vars(args), "rounds": []}
    try:
        meshes["traced"] = start_mesh(engine_args, traced_env, args.num_prompts)
        meshes["untraced"] = start_mesh(engine_args, untraced_env, args.num_prompts)
        model = engine_args.model
        for i in range(args.rounds):
            requests = synthetic_requests(tokenizer, args.num_prompts, args.input_len, args.output_len, args.seed + i)
            order = ["traced", "untraced"] if i % 2 == 0 else ["untraced", "traced"]
            entry = {}
            for name in order:
                address = meshes[name].services["gateway"].address
                results, elapsed = asyncio.run(
                    run_mesh(address, requests, float("inf"), 1.0, args.max_concurrency, args.seed, model, None)
                )
                entry[name] = summarize(results, elapsed, {})
                print_table(f"round {i + 1}: {name}", entry[name])
            ratio = entry["traced"]["output_token_throughput"] / entry["untraced"]["output_token_throughput"]
            added = entry["traced"]["ttft_ms"]["p50"] - entry["untraced"]["ttft_ms"]["p50"]
            entry["traced_over_untraced"] = {"output_throughput_ratio": ratio, "median_ttft_added_ms": added}
            print(f"\nround {i + 1}: traced / untraced output tok/s {ratio:.3f}x; median TTFT added {added:.1f} ms")
            report["rounds"].append(entry)
    finally:
        for mesh in meshes.values():
            mesh.stop()
        sink.server.stop(0)
    report["otlp_sink"] = {"exports": sink.exports, "bytes": sink.bytes}
    print(
        f"\n{median_over_rounds(report, 'traced_over_untraced', 'traced / untraced', 'tracing')}; "
        f"the sink took {sink.exports} exports, {sink.bytes} bytes"
    )
    write_report(args.output_json, report)


if __name__ == "__main__":
    sys.exit(main())
