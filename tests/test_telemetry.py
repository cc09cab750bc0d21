"""Traces and metrics of the whole mesh as real processes: a real OTLP/gRPC receiver (opentelemetry-proto's
TraceService on a grpc server of this test) collects what every service exports, and each service's Prometheus
/metrics is scraped and parsed with prometheus_client's parser."""

import json
import re
import threading
import urllib.request
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineArgs
from llmmesh.v1 import gateway_pb2
from services.client import collect, gateway_stub, generate, sampling_params
from services.engine_telemetry import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from services.local_mesh import Mesh

pytestmark = pytest.mark.slow

# A small KV cache (12 blocks of 16 tokens), so a few long requests at once preempt each other.
KV = "9MiB"
PROMPT = "The capital of France is"
LONG_PROMPT = (
    "In the beginning there was a long shared system prompt that every request of this test starts with, "
    "so that the second request finds its blocks in the prefix cache:"
)
WAIT_S = 60.0  # a bound on waiting for spans to arrive (the test waits for them, it asserts no speed)


# ---- a real OTLP/gRPC receiver --------------------------------------------------------------------------


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class Span:
    def __init__(self, service: str, span: trace_pb2.Span):
        self.service = service
        self.name = span.name
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_id = span.parent_span_id.hex()
        self.kind = span.kind
        self.start, self.end = span.start_time_unix_nano, span.end_time_unix_nano
        self.attributes = {kv.key: _value(kv.value) for kv in span.attributes}
        self.events = [(e.name, {kv.key: _value(kv.value) for kv in e.attributes}) for e in span.events]
        self.links = [(link.trace_id.hex(), link.span_id.hex()) for link in span.links]
        self.status = span.status

    def __repr__(self):
        return f"<{self.service} {self.name} {self.span_id} <- {self.parent_id}>"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span; wait() blocks until a condition on them holds."""

    def __init__(self):
        self.spans: list[Span] = []
        self.changed = threading.Condition()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            service = next((kv.value.string_value for kv in rs.resource.attributes if kv.key == "service.name"), "")
            spans += [Span(service, s) for ss in rs.scope_spans for s in ss.spans]
        with self.changed:
            self.spans += spans
            self.changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait(self, condition, timeout=WAIT_S, what=lambda spans: spans):
        with self.changed:
            assert self.changed.wait_for(lambda: condition(self.spans), timeout), (
                f"the spans never satisfied the condition: {what(self.spans)}"
            )

    def trace(self, trace_id: str) -> list[Span]:
        with self.changed:
            return [s for s in self.spans if s.trace_id == trace_id]


def root_of(spans, request_id):
    return next(
        (
            s
            for s in spans
            if s.service == "llmmesh-gateway"
            and s.attributes.get("gen_ai.response.id") == request_id
            or s.attributes.get("gen_ai.request.id") == request_id
            and s.parent_id == ""
        ),
        None,
    )


# The spans of one request, by (service, name), and what their parents are.
EXPECTED_TREE = {
    ("llmmesh-gateway", "llmmesh.v1.Tokenizer/Tokenize"): ("llmmesh-gateway", "ROOT"),
    ("llmmesh-tokenizer", "llmmesh.v1.Tokenizer/Tokenize"): ("llmmesh-gateway", "llmmesh.v1.Tokenizer/Tokenize"),
    ("llmmesh-gateway", "llmmesh.v1.Engine/Generate"): ("llmmesh-gateway", "ROOT"),
    ("llmmesh-engine", "llmmesh.v1.Engine/Generate"): ("llmmesh-gateway", "llmmesh.v1.Engine/Generate"),
    ("llmmesh-engine", "llm_request"): ("llmmesh-engine", "llmmesh.v1.Engine/Generate"),
    ("llmmesh-engine", "queue"): ("llmmesh-engine", "llm_request"),
    ("llmmesh-engine", "prefill"): ("llmmesh-engine", "llm_request"),
    ("llmmesh-engine", "decode"): ("llmmesh-engine", "llm_request"),
    ("llmmesh-gateway", "llmmesh.v1.Detokenizer/Detokenize"): ("llmmesh-gateway", "ROOT"),
    ("llmmesh-detokenizer", "detokenize"): ("llmmesh-gateway", "llmmesh.v1.Detokenizer/Detokenize"),
}


class Traces:
    """The receiver, seen one request at a time."""

    def __init__(self, receiver: Receiver):
        self.receiver = receiver

    def of(self, request_id: str, complete: bool = True) -> tuple[Span, list[Span]]:
        """The root span of the request with this (client) id and its whole trace, once every span of EXPECTED_TREE
        (complete) or at least the root is in."""

        def ready(spans):
            root = root_of(spans, request_id)
            if root is None:
                return False
            names = {(s.service, s.name) for s in spans if s.trace_id == root.trace_id}
            return not complete or set(EXPECTED_TREE) <= names

        def missing(spans):
            root = root_of(spans, request_id)
            if root is None:
                return f"no root span for {request_id}"
            return f"missing {set(EXPECTED_TREE) - {(s.service, s.name) for s in spans if s.trace_id == root.trace_id}}"

        self.receiver.wait(ready, what=missing)
        root = root_of(self.receiver.spans, request_id)
        return root, self.receiver.trace(root.trace_id)


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.server.stop(0)


ENV = {
    "OTEL_BSP_SCHEDULE_DELAY": "50",  # export every 50 ms (the SDK's default is 5 s)
    "LLMMESH_METRICS_PORT": "0",  # every service on a free port, announced on stdout
    "LLMMESH_COLLECT_DETAILED_TRACES": "all",
}


@pytest.fixture(scope="module")
def mesh(receiver):
    with Mesh(
        EngineArgs(kv_cache_memory=KV),
        kv_store=True,
        sampler=True,
        env={**ENV, "LLMMESH_OTLP_TRACES_ENDPOINT": f"127.0.0.1:{receiver.port}"},
    ) as m:
        yield m


@pytest.fixture(scope="module")
def gateway(mesh):
    return mesh.services["gateway"].address


@pytest.fixture(scope="module")
def traces(receiver):
    return Traces(receiver)


def by_key(spans):
    return {(s.service, s.name): s for s in spans}


# ---- traces -------------------------------------------------------------------------------------------


def test_one_streamed_request_is_one_trace_across_every_service(gateway, traces):
    result = collect(generate(gateway, PROMPT, request_id="one-trace", temperature=0.0, max_tokens=12, ignore_eos=True))
    usage, choice = result.complete.usage, result.choice(0)
    root, spans = traces.of("one-trace")
    assert len({s.trace_id for s in spans}) == 1
    # A normal finish marks no span failed, and the gateway let the engine's call end by itself (OK, not CANCELLED).
    assert not [s for s in spans if s.status.code == trace_pb2.Status.STATUS_CODE_ERROR]
    assert by_key(spans)[("llmmesh-engine", "llmmesh.v1.Engine/Generate")].attributes["rpc.grpc.status_code"] == 0
    assert root.name == f"text_completion {root.attributes['gen_ai.request.model']}"
    assert root.parent_id == ""  # a new trace: the client sent no traceparent
    spans_by = by_key(spans)
    ids = {s.span_id: s for s in spans}
    for key, (parent_service, parent_name) in EXPECTED_TREE.items():
        parent = ids.get(spans_by[key].parent_id)
        expected = root if parent_name == "ROOT" else spans_by[(parent_service, parent_name)]
        assert parent is expected, f"{key}: parent {parent}, expected {expected}"
    # GenAI conventions and vLLM's latency attributes on the root; the token counts are the client's usage.
    a = root.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens == 12
    assert a["gen_ai.response.finish_reasons"] == [choice.finish_reason] == ["length"]
    assert a["gen_ai.response.id"] == "one-trace"
    for name in ("time_in_queue", "time_to_first_token", "e2e", "time_in_model_prefill", "time_in_model_decode"):
        assert a[f"gen_ai.latency.{name}"] >= 0.0, name
    assert a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    engine_request = spans_by[("llmmesh-engine", "llm_request")].attributes
    assert engine_request["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert engine_request["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert engine_request["gen_ai.response.finish_reasons"] == ["length"]
    assert spans_by[("llmmesh-detokenizer", "detokenize")].attributes["gen_ai.usage.output_tokens"] == 12
    # The phases follow each other inside the request.
    queue, prefill, decode = (spans_by[("llmmesh-engine", n)] for n in ("queue", "prefill", "decode"))
    assert queue.end <= prefill.start + 1000 and prefill.end <= decode.start + 1000  # ns: clock conversions round
    # --collect-detailed-traces: each engine step that produced a token of this request, with its batch and its time
    # split into schedule, model, sample (and update).
    steps = [s for s in spans if s.name.startswith("step ")]
    assert sum(s.attributes["llmmesh.step.new_tokens"] for s in steps) == 12
    for s in steps:
        assert s.attributes["llmmesh.step.batch_requests"] >= 1
        for part in ("schedule", "model", "sample", "update"):
            assert s.attributes[f"llmmesh.step.{part}_seconds"] > 0.0, part

    # Each links to the step's own span (a trace of its own: a step serves many requests), under which the sampler
    # service sampled that step.
    def sampled_under(link):
        return [s for s in traces.receiver.trace(link[0]) if s.service == "llmmesh-sampler" and s.parent_id == link[1]]

    links = [link for s in steps for link in s.links]
    assert len(links) == len(steps)
    traces.receiver.wait(
        lambda _: all(sampled_under(link) for link in links),
        what=lambda _: [link for link in links if not sampled_under(link)],
    )
    for s, (trace_id, span_id) in zip(steps, links):
        engine_step = next(e for e in traces.receiver.trace(trace_id) if e.span_id == span_id)
        assert engine_step.name == "engine_step" and engine_step.parent_id == ""
        assert engine_step.attributes["llmmesh.step"] == s.attributes["llmmesh.step"]
        assert [x.name for x in sampled_under((trace_id, span_id))] == ["llmmesh.v1.Sampler/Sample step"]


def test_a_client_traceparent_joins_the_clients_trace(gateway, traces):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    request = gateway_pb2.GenerateRequest(
        text=PROMPT, stream=True, request_id="joined", sampling_params=sampling_params(temperature=0.0, max_tokens=4)
    )
    collect(gateway_stub(gateway).Generate(request, metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")]))
    root, spans = traces.of("joined")
    assert root.trace_id == trace_id and root.parent_id == parent_id
    assert all(s.trace_id == trace_id for s in spans)


def test_an_invalid_request_has_an_error_span_with_its_code(gateway, traces):
    with pytest.raises(grpc.RpcError) as info:
        collect(generate(gateway, PROMPT, request_id="invalid", temperature=-1.0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    root, _ = traces.of("invalid", complete=False)
    assert root.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert root.status.message.startswith("INVALID_ARGUMENT: ")
    assert root.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_a_stop_string_abort_shows(mesh, gateway, traces):
    text = collect(generate(gateway, PROMPT, temperature=0.0, max_tokens=16, ignore_eos=True)).text()
    stop = text.split()[2]
    before = scrape(mesh, "engine")
    result = collect(
        generate(gateway, PROMPT, request_id="stopped", temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    )
    assert result.choice(0).stop_str == stop
    root, spans = traces.of("stopped", complete=False)
    assert (
        "stop_string",
        {"gen_ai.response.choice.index": 0, "llmmesh.stop_str": stop, "llmmesh.engine_aborted": True},
    ) in root.events
    wanted = {("llmmesh-gateway", "stop_string_abort"), ("llmmesh-engine", "llmmesh.v1.Engine/Generate")}
    traces.receiver.wait(lambda _: wanted <= set(by_key(traces.receiver.trace(root.trace_id))))
    assert root.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    # The gateway told the engine that a stop string ended the request: the engine's call ends by itself (OK, not
    # cancelled), the engine counts the request as finished by a stop, and no span of it is marked failed.
    engine = by_key(traces.receiver.trace(root.trace_id))[("llmmesh-engine", "llmmesh.v1.Engine/Generate")]
    assert engine.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    assert not [s for s in traces.receiver.trace(root.trace_id) if s.status.code == trace_pb2.Status.STATUS_CODE_ERROR]
    after = scrape(mesh, "engine")
    assert delta(before, after, "vllm:request_success_total", finished_reason="stop") == 1
    assert delta(before, after, "vllm:request_success_total", finished_reason="abort") == 0


def test_a_preempted_request_shows_its_preemption(gateway, traces):
    # Two requests of 70 + 50 tokens fit the cache (12 blocks of 16) when they start, but not once they have
    # grown (2 x 8 blocks): the scheduler preempts one.
    ids = [f"preempt-{i}" for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(
            pool.map(
                lambda rid: collect(
                    generate(
                        gateway,
                        f"({rid}) {LONG_PROMPT} {LONG_PROMPT}",
                        request_id=rid,
                        temperature=0.0,
                        max_tokens=50,
                        ignore_eos=True,
                    )
                ),
                ids,
            )
        )
    preempted = []
    for rid in ids:
        _, spans = traces.of(rid)
        request = by_key(spans)[("llmmesh-engine", "llm_request")]
        if request.attributes["llmmesh.num_preemptions"]:
            preempted.append(request)
    assert preempted, "no request was preempted"
    for request in preempted:
        events = [name for name, _ in request.events]
        assert events.count("preempted") == request.attributes["llmmesh.num_preemptions"]


def test_kv_store_loads_and_stores_are_in_the_request_trace(mesh, gateway, traces):
    prefix = f"(kv) {LONG_PROMPT} {LONG_PROMPT}"  # 4 full blocks of 16 tokens
    before = scrape(mesh, "engine")
    collect(generate(gateway, f"{prefix} First question?", request_id="kv-first", temperature=0.0, max_tokens=2))
    # About 180 tokens take every block of the 12-block cache: the first request's blocks leave the prefix cache
    # (the KV store keeps them).
    collect(generate(gateway, "the" + " the" * 179, temperature=0.0, max_tokens=1))
    collect(generate(gateway, f"{prefix} Second question?", request_id="kv-second", temperature=0.0, max_tokens=2))
    after = scrape(mesh, "engine")

    def kvstore_spans(request_id, method):
        """The kvstore's server spans of this method in the request's trace, and the engine's llm_request span."""
        _, spans = traces.of(request_id)
        request = by_key(spans)[("llmmesh-engine", "llm_request")]
        return request, [
            s
            for s in traces.receiver.trace(request.trace_id)
            if s.service == "llmmesh-kvstore" and s.name == f"llmmesh.v1.KVStore/{method}"
        ]

    # The first request stored its prompt's blocks: a store event, and the kvstore's Put under its llm_request span.
    traces.receiver.wait(lambda _: kvstore_spans("kv-first", "Put")[1], what=lambda _: "no Put in kv-first's trace")
    request, puts = kvstore_spans("kv-first", "Put")
    assert ("kv_store_started", {"llmmesh.kv_store.tokens": 64}) in request.events
    assert all(
        put.parent_id == request.span_id and put.status.code != trace_pb2.Status.STATUS_CODE_ERROR for put in puts
    )
    # The second found them in the store (Lookup) and loaded them (Get), all inside its own trace.
    traces.receiver.wait(lambda _: kvstore_spans("kv-second", "Get")[1], what=lambda _: "no Get in kv-second's trace")
    request, gets = kvstore_spans("kv-second", "Get")
    _, lookups = kvstore_spans("kv-second", "Lookup")
    events = dict(request.events)
    loaded = events["kv_loaded"]["llmmesh.kv_store.tokens"]
    assert loaded == events["kv_load_started"]["llmmesh.kv_store.tokens"] == 64
    assert len(gets) == 1 and gets[0].parent_id == request.span_id
    assert lookups and all(lookup.parent_id == request.span_id for lookup in lookups)
    # The engine's KV connector counters, under vLLM's names.
    assert delta(before, after, "vllm:external_prefix_cache_hits_total") >= loaded
    assert delta(before, after, "vllm:external_prefix_cache_queries_total") >= delta(
        before, after, "vllm:external_prefix_cache_hits_total"
    )
    assert delta(before, after, "vllm:kv_offload_load_bytes_total") > 0
    assert delta(before, after, "vllm:kv_offload_store_bytes_total") > 0


def test_untraced_requests_export_nothing(mesh, gateway, traces):
    gateways = []
    try:
        for flags, rid in ((["--otlp-traces-endpoint", ""], "off"), (["--trace-sample-ratio", "0"], "unsampled")):
            gateways.append(mesh.start_gateway(flags))
            collect(generate(gateways[-1].address, PROMPT, request_id=rid, temperature=0.0, max_tokens=4))
        # A traced request after them: once its spans are in, theirs would be too (each service exports in order).
        collect(generate(gateway, PROMPT, request_id="after", temperature=0.0, max_tokens=4))
        traces.of("after")
        for rid in ("off", "unsampled"):
            assert not [
                s
                for s in traces.receiver.spans
                if str(s.attributes.get("gen_ai.request.id", "")).startswith(rid)
                or s.attributes.get("gen_ai.response.id") == rid
            ]
    finally:
        for process in gateways:
            process.stop()


# ---- metrics --------------------------------------------------------------------------------------------


def scrape(mesh, name: str) -> dict:
    """{(sample name, sorted labels): value} from the service's /metrics."""
    address = mesh.services[name].metrics_address
    assert address, f"the {name} announced no metrics address"
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def delta(before, after, name, **labels):
    matches = [k for k in after if k[0] == name and all(dict(k[1]).get(n) == v for n, v in labels.items())]
    assert matches, f"{name} {labels} is not exported"
    return sum(after[k] - before.get(k, 0.0) for k in matches)


def buckets(samples, name):
    return sorted(float(dict(k[1])["le"]) for k in samples if k[0] == f"{name}_bucket" and dict(k[1])["le"] != "+Inf")


def test_metrics_count_a_known_workload(mesh, gateway):
    services = ["engine", "gateway", "tokenizer", "detokenizer", "kvstore"]
    before = {name: scrape(mesh, name) for name in services}
    results = [
        collect(generate(gateway, prompt, temperature=0.0, max_tokens=n, ignore_eos=True))
        for prompt, n in ((LONG_PROMPT, 5), (LONG_PROMPT, 7), (PROMPT, 3))
    ]
    after = {name: scrape(mesh, name) for name in services}
    engine_before, engine = before["engine"], after["engine"]
    prompt_tokens = sum(r.complete.usage.prompt_tokens for r in results)
    assert delta(engine_before, engine, "vllm:prompt_tokens_total") == prompt_tokens
    assert delta(engine_before, engine, "vllm:generation_tokens_total") == 5 + 7 + 3
    assert delta(engine_before, engine, "vllm:request_success_total", finished_reason="length") == 3
    cached = sum(r.complete.usage.cached_tokens for r in results)
    assert cached > 0  # the second long prompt found the first one's blocks
    assert delta(engine_before, engine, "vllm:prefix_cache_hits_total") >= cached
    assert delta(engine_before, engine, "vllm:prefix_cache_queries_total") >= delta(
        engine_before, engine, "vllm:prefix_cache_hits_total"
    )
    assert delta(engine_before, engine, "vllm:time_to_first_token_seconds_count") == 3
    assert delta(engine_before, engine, "vllm:e2e_request_latency_seconds_count") == 3
    assert delta(engine_before, engine, "vllm:inter_token_latency_seconds_count") == (5 - 1) + (7 - 1) + (3 - 1)
    assert delta(engine_before, engine, "vllm:iteration_tokens_total_count") >= 7
    model = dict(next(k for k in engine if k[0] == "vllm:num_requests_running")[1])["model_name"]
    assert model
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
    ):
        assert (name, (("model_name", model),)) in engine
    # vLLM's buckets.
    assert buckets(engine, "vllm:time_to_first_token_seconds") == TTFT_BUCKETS
    assert buckets(engine, "vllm:inter_token_latency_seconds") == ITL_BUCKETS
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert buckets(engine, f"vllm:{name}_seconds") == REQUEST_LATENCY_BUCKETS
    # The gateway counts requests by method and code; every service counts its own RPCs.
    assert (
        delta(before["gateway"], after["gateway"], "grpc_server_handled_total", grpc_method="Generate", grpc_code="OK")
        == 3
    )
    assert (
        delta(
            before["tokenizer"], after["tokenizer"], "grpc_server_handled_total", grpc_method="Tokenize", grpc_code="OK"
        )
        == 3
    )
    # Each engine call ended by itself once its request finished (the gateway does not cancel it).
    assert (
        delta(
            before["engine"],
            after["engine"],
            "grpc_server_handled_total",
            grpc_service="llmmesh.v1.Engine",
            grpc_method="Generate",
            grpc_code="OK",
        )
        == 3
    )
    with pytest.raises(grpc.RpcError):
        collect(generate(gateway, PROMPT, temperature=-1.0))
    assert (
        delta(
            after["gateway"],
            scrape(mesh, "gateway"),
            "grpc_server_handled_total",
            grpc_method="Generate",
            grpc_code="INVALID_ARGUMENT",
        )
        == 1
    )
    # The kvstore: its hits, misses, bytes and corrupt blocks.
    kvstore = after["kvstore"]
    for name in ("hits", "misses", "bytes_in", "bytes_out", "corrupt_blocks", "blocks_stored"):
        assert (f"llmmesh:kvstore_{name}_total", ()) in kvstore, name


def test_the_grafana_dashboard_shows_only_metrics_the_services_export(mesh, gateway):
    collect(generate(gateway, PROMPT, temperature=0.0, max_tokens=2))  # every histogram has a sample
    exported = {sample for name in mesh.services for sample, _ in scrape(mesh, name)}
    queries = []  # every panel's "expr" and every variable's "query"

    def collect_queries(obj):
        queries.extend(v for k, v in obj.items() if k in ("expr", "query") and isinstance(v, str))
        return obj

    json.loads(
        (Path(__file__).parent.parent / "docs/observability/grafana-dashboard.json").read_text(),
        object_hook=collect_queries,
    )
    # The metric names: what is left of a query without its label matchers and its by (...) label lists.
    selectors = [re.sub(r"\{[^}]*\}|\b(?:by|without)\s*\([^)]*\)", " ", q) for q in queries]
    used = {name for q in selectors for name in re.findall(r"\b(?:vllm:|llmmesh:|grpc_)[a-zA-Z0-9_:]+", q)}
    assert len(used) >= 20, used  # the dashboard's panels were found
    assert used <= exported, f"the dashboard uses metrics no service exports: {sorted(used - exported)}"
