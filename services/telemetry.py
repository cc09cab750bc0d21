"""Traces (OpenTelemetry, exported over OTLP/gRPC) and metrics (Prometheus) for every service, set up once.

`services.server.Server` builds one Telemetry per service from the flags `config.service_parser` gives every
service: --otlp-traces-endpoint (vLLM's flag; OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is its default, as in vLLM),
--trace-sample-ratio and --metrics-port. Both are off by default, and off they cost nothing: no tracer
provider exists, handlers are not wrapped, `tracer` is None and every span helper below returns at once.

Context travels as W3C `traceparent`/`tracestate` in gRPC metadata: `inject()` gives the metadata for an
outgoing call, `server_span()` starts a server span under the caller's context. The mesh never touches the
global OpenTelemetry state (several services can share one process in tests): each Telemetry has its own
tracer provider and its own Prometheus registry. The registry is served by services/metrics_server.py, and
services/handler_telemetry.py wraps every handler of a server with a span and a count.
"""

import contextlib
import contextvars
import logging
import time

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter

from engine.config.utils import add_cli_args
from services.metrics_server import DictCounters, serve_metrics
from services.settings import ObservabilityConfig

logger = logging.getLogger("llmmesh.telemetry")

PROPAGATOR = TraceContextTextMapPropagator()
# The server span of the RPC this task serves (set by the handler wrapper; one task per RPC in grpc.aio).
CURRENT_SERVER_SPAN: contextvars.ContextVar = contextvars.ContextVar("llmmesh_server_span", default=None)


def add_args(parser) -> None:
    add_cli_args(parser, ObservabilityConfig)


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() instant as the wall-clock nanoseconds OpenTelemetry timestamps are in."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def trace_id_of(span) -> str:
    """The span's trace id in hex (what a trace viewer searches for), '' for none."""
    ctx = span.get_span_context() if span is not None else None
    return format(ctx.trace_id, "032x") if ctx is not None and ctx.is_valid else ""


class TraceIdFilter(logging.Filter):
    """Adds `trace` to every log record: " trace=<id>" inside a traced RPC of this process, else ""."""

    def filter(self, record: logging.LogRecord) -> bool:
        trace_id = trace_id_of(CURRENT_SERVER_SPAN.get())
        record.trace = f" trace={trace_id}" if trace_id else ""
        return True


def set_error(span, code: grpc.StatusCode, message: str) -> None:
    """A failed span: ERROR status with the gRPC code and message (and the code as rpc.grpc.status_code)."""
    if span is None:
        return
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    span.set_attribute("error.type", code.name)
    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))


class Telemetry:
    """One service's tracer (None when tracing is off) and metrics registry (served when --metrics-port is set)."""

    def __init__(self, service: str, args):
        self.service = service
        self.endpoint = getattr(args, "otlp_traces_endpoint", None) or None
        self.metrics_port = getattr(args, "metrics_port", None)
        self.metrics_host = getattr(args, "host", "127.0.0.1")
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics_server = None
        self.provider = self.tracer = None
        if self.endpoint:
            ratio = getattr(args, "trace_sample_ratio", 1.0)
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"--trace-sample-ratio must be in [0, 1], got {ratio}")
            self._start_tracing(ratio)
        self.grpc_handled = None
        if self.metrics_port is not None:
            self.grpc_handled = Counter(
                "grpc_server_handled",
                "RPCs completed on the server, by method and gRPC status code",
                ["grpc_service", "grpc_method", "grpc_code"],
                registry=self.registry,
            )

    def _start_tracing(self, ratio: float) -> None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        endpoint = self.endpoint
        insecure = not endpoint.startswith("https://")
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": f"llmmesh-{self.service}", "service.namespace": "llmmesh"}),
            sampler=ParentBased(TraceIdRatioBased(ratio)),
        )
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
        self.tracer = self.provider.get_tracer("llmmesh")
        logger.info("tracing: OTLP/gRPC to %s, sampling %.3g of requests", endpoint, ratio)

    @property
    def active(self) -> bool:
        """Whether handlers need wrapping at all (tracing or metrics on)."""
        return self.tracer is not None or self.grpc_handled is not None

    def start(self) -> None:
        if self.metrics_port is not None and self.metrics_server is None:
            self.metrics_server = serve_metrics(self.registry, self.metrics_host, self.metrics_port)
            self.metrics_port = self.metrics_server.server_port
            # On stdout before the "listening on" line, for whoever started the process (services/service_process.py).
            print(f"llmmesh {self.service} metrics on {self.metrics_host}:{self.metrics_port}", flush=True)

    def count(self, prefix: str, counters) -> None:
        """Export a service's own cumulative counters (a dict, read at scrape) as `<prefix><name>_total`."""
        if self.metrics_port is not None:
            self.registry.register(DictCounters(prefix, counters))

    def shutdown(self) -> None:
        """Export what is left (spans end with the requests, before the server stops) and stop serving metrics."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = self.tracer = None
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None

    # ---- spans --------------------------------------------------------------------------------

    def start_span(
        self,
        name: str,
        parent=None,
        kind=SpanKind.INTERNAL,
        start_s: float | None = None,
        attributes=None,
        context=None,
        links=None,
    ):
        """A span under `parent` (a span, or None for the `context` given / a new trace); None when tracing is off.
        start_s: a time.monotonic() instant."""
        if self.tracer is None:
            return None
        if parent is not None:
            context = trace.set_span_in_context(parent)
        return self.tracer.start_span(
            name,
            context=context,
            kind=kind,
            attributes=attributes,
            links=links,
            start_time=None if start_s is None else epoch_ns(start_s),
        )

    def span_between(self, name: str, parent, start_s: float | None, end_s: float | None, attributes=None, links=None):
        """A finished child span over [start_s, end_s] (time.monotonic() instants), when both are known."""
        if parent is None or start_s is None or end_s is None:
            return None
        span = self.start_span(name, parent, start_s=start_s, attributes=attributes, links=links)
        span.end(end_time=epoch_ns(end_s))
        return span

    def server_span(self, name: str, metadata, kind=SpanKind.SERVER, attributes=None):
        """A span continuing the caller's trace from its gRPC metadata; None when tracing is off or the caller
        sent no traceparent (health checks, the gateway's shared detokenizer stream)."""
        if self.tracer is None:
            return None
        carrier = {k: v for k, v in metadata or () if k in ("traceparent", "tracestate")}
        if "traceparent" not in carrier:
            return None
        return self.tracer.start_span(name, context=PROPAGATOR.extract(carrier), kind=kind, attributes=attributes)

    @contextlib.contextmanager
    def client_call(self, name: str, parent, attributes=None):
        """A client span around a call to another service (None inside when not traced); a RequestError or a
        gRPC error out of the block marks it failed."""
        if parent is None:
            yield None
            return
        span = self.start_span(name, parent, SpanKind.CLIENT, attributes=attributes)
        try:
            yield span
        except Exception as e:
            code = getattr(e, "code", None)
            code = code() if callable(code) else code
            if isinstance(code, grpc.StatusCode):
                set_error(span, code, getattr(e, "message", None) or str(e))
            raise
        finally:
            span.end()

    def new_trace(self, name: str, attributes=None):
        """A server span that starts a new trace (sampled at --trace-sample-ratio)."""
        if self.tracer is None:
            return None
        return self.tracer.start_span(
            name, context=trace.set_span_in_context(trace.INVALID_SPAN), kind=SpanKind.SERVER, attributes=attributes
        )


def inject(span) -> tuple:
    """gRPC metadata carrying span's context (traceparent, tracestate) to the next service; () without a span."""
    if span is None:
        return ()
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


# ---- the GenAI semantic conventions (and vLLM's latency attributes) on a request's root span ---------------


def genai_request_attributes(operation: str, model: str, params, request_id: str = "") -> dict:
    """gen_ai.* request attributes from a llmmesh.v1 SamplingParams message (fields left unset are left out)."""
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "gen_ai.system": "llmmesh",
        "gen_ai.request.choice.count": params.n or 1,
    }
    if request_id:
        attributes["gen_ai.request.id"] = request_id
    for field in ("temperature", "top_p", "top_k", "max_tokens", "seed", "frequency_penalty", "presence_penalty"):
        if params.HasField(field):
            attributes[f"gen_ai.request.{field}"] = getattr(params, field)
    if params.stop:
        attributes["gen_ai.request.stop_sequences"] = list(params.stop)
    return attributes


def lora_attributes(lora_name: str) -> dict:
    """The LoRA adapter a request runs with, as span attributes on its gateway and engine spans (none for the base
    model)."""
    return {"llmmesh.lora_name": lora_name} if lora_name else {}


def set_response_attributes(span, response_id: str, complete) -> None:
    """Usage, finish reasons and latencies of a finished request (a gateway Complete message) on its root span."""
    if span is None or not span.is_recording():
        return
    t = complete.timings
    span.set_attributes(
        {
            "gen_ai.response.id": response_id,
            "gen_ai.response.finish_reasons": [c.finish_reason for c in complete.choices],
            "gen_ai.usage.input_tokens": complete.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": complete.usage.completion_tokens,
            "gen_ai.usage.cached_tokens": complete.usage.cached_tokens,
            "gen_ai.latency.time_in_queue": t.queue_time,
            "gen_ai.latency.time_to_first_token": t.time_to_first_token,
            "gen_ai.latency.e2e": t.e2e_latency,
            "gen_ai.latency.time_in_model_prefill": t.prefill_time,
            "gen_ai.latency.time_in_model_decode": t.decode_time,
        }
    )
    logger.info(
        "request %s finished (%s): %d prompt + %d generated tokens",
        response_id,
        ",".join(c.finish_reason for c in complete.choices),
        complete.usage.prompt_tokens,
        complete.usage.completion_tokens,
    )
