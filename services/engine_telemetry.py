"""The engine service's metrics (vLLM's names, types and buckets) and request spans, from data the engine keeps.

Nothing here instruments the engine core. Metrics: the scheduler's state (SchedulerStats, refreshed after
every step) is read when Prometheus scrapes; per-request histograms and counters are observed when a request's
stream ends, from its RequestState timings; the per-step token histogram comes from AsyncLLM.on_step. Spans:
a request's `llm_request` span starts at its arrival, and its context rides into the engine with the request
(Request.trace_headers), so the kvstore's spans of its KV transfers are its children; at its end, its
lifecycle (first scheduled, first token, last token, preemptions, KV transfers) becomes the span's attributes,
events and queue, prefill and decode children, timestamped when things happened. With detailed traces, each
step is an `engine_step` span (AsyncLLM.on_step_start / on_step), whose context goes to the sampler service.
"""

import logging
import time

from opentelemetry.trace import Link, Status, StatusCode
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.request import FinishReason
from services.telemetry import Telemetry, epoch_ns, inject, lora_attributes

logger = logging.getLogger("llmmesh.engine")

# vLLM's buckets (vllm/v1/metrics/loggers.py).
# fmt: off
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# fmt: on
# The KV connector's counters (SchedulerStats.kv_connector_stats) under vLLM's names for a KV connector's external
# prefix cache and offloaded bytes; the others are exported as llmmesh:kv_connector_<key>.
KV_CONNECTOR_METRICS = {
    "lookup_tokens": (
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
        "number of queried tokens.",
    ),
    "lookup_hit_tokens": (
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
        "number of cached tokens.",
    ),
    "loaded_bytes": ("vllm:kv_offload_load_bytes", "Number of bytes loaded by KV connector."),
    "stored_bytes": ("vllm:kv_offload_store_bytes", "Number of bytes offloaded by KV connector."),
}


class SchedulerCollector:
    """vLLM's scheduler gauges and cumulative counters, read from the engine's latest SchedulerStats at scrape."""

    def __init__(self, owner, model_name: str):
        self.owner = owner  # the EngineServicer: .engine is the AsyncLLM, None while loading
        self.model_name = model_name
        self.stats_time = time.time()  # when the engine last stepped: vllm:lora_requests_info's value

    def describe(self):
        return []

    def collect(self):
        engine = self.owner.engine
        stats = engine.stats if engine is not None else None
        if stats is None:
            return
        labels = [self.model_name]
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running_reqs),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting_reqs),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
            # vLLM's name before vllm:kv_cache_usage_perc, which dashboards and endpoint pickers still read.
            (
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage. Deprecated: use vllm:kv_cache_usage_perc.",
                stats.kv_cache_usage,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        counters = [
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                stats.prefix_cache_hits,
            ),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.num_preemptions),
        ]
        counters += [
            ("llmmesh:telemetry_hook_errors", "Telemetry hooks that raised (logged and ignored).", engine.hook_errors),
            (
                "llmmesh:kv_event_drops",
                "KV event batches dropped from subscribers that fell behind.",
                engine.kv_event_drops,
            ),
        ]
        encoder = stats.encoder_cache_stats
        if encoder is not None:
            for key, doc in (
                ("queries", "Images looked up in the encoder cache."),
                ("hits", "Images whose embeddings the encoder cache held."),
                ("computed", "Images the vision encoder computed."),
            ):
                counters.append((f"llmmesh:encoder_cache_{key}", doc, getattr(encoder, key)))
            gauge = GaugeMetricFamily(
                "llmmesh:encoder_cache_usage_perc",
                "Encoder cache usage (image embedding tokens requests need). 1 means 100 percent usage.",
                labels=["model_name"],
            )
            gauge.add_metric(labels, stats.encoder_cache_usage)
            yield gauge
        for key, value in sorted((stats.kv_connector_stats or {}).items()):
            name, doc = KV_CONNECTOR_METRICS.get(key, (f"llmmesh:kv_connector_{key}", f"KV connector: {key}."))
            counters.append((name, doc, value))
        # vLLM's speculative-decoding counters (cumulative): acceptance rate = accepted / draft tokens, mean
        # acceptance length = 1 + accepted / drafts.
        spec = stats.spec_decoding_stats
        if spec is not None:
            counters += [
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
            ]
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        if spec is not None:
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=["model_name", "position"],
            )
            for position, value in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos.add_metric([*labels, str(position)], value)
            yield per_pos
        yield self.cache_config_info(engine.info)
        if engine.info.enable_lora:
            yield self.lora_info(engine.info.max_loras, stats)

    @staticmethod
    def cache_config_info(info) -> GaugeMetricFamily:
        """vLLM's vllm:cache_config_info: the KV cache's settings as labels (an endpoint picker reads block_size and
        num_gpu_blocks to size its prefix index), the value 1."""
        settings = {
            "block_size": info.block_size,
            "num_gpu_blocks": info.num_blocks,
            "enable_prefix_caching": info.enable_prefix_caching,
            "prefix_caching_hash_algo": info.prefix_caching_hash_algo,
        }
        gauge = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=settings)
        gauge.add_metric([str(v) for v in settings.values()], 1.0)
        return gauge

    def lora_info(self, max_loras: int, stats) -> GaugeMetricFamily:
        """vLLM's vllm:lora_requests_info: the adapters with requests running and waiting as labels (comma-separated
        names), the time of the last update as the value."""
        gauge = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        waiting, running = ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters)
        gauge.add_metric([str(max_loras), waiting, running], self.stats_time)
        return gauge


def step_attributes(step) -> dict:
    """A step's batch and its time split (a StepStats), as span attributes."""
    return {
        "llmmesh.step": step.step,
        "llmmesh.step.batch_requests": step.num_reqs,
        "llmmesh.step.batch_tokens": step.num_tokens,
        "llmmesh.step.schedule_seconds": step.schedule_s,
        "llmmesh.step.model_seconds": step.model_s,
        "llmmesh.step.sample_seconds": step.sample_s,
        "llmmesh.step.update_seconds": step.update_s,
    }


class EngineTelemetry:
    """The engine service's observer: watch() a request when tracing or metrics are on (None otherwise)."""

    def __init__(self, telemetry: Telemetry, owner, model_name: str, detailed_traces: bool = False):
        self.telemetry = telemetry
        self.model_name = model_name
        self.metrics = telemetry.metrics_port is not None
        self.detailed = detailed_traces and telemetry.tracer is not None
        # engine request id -> [(StepStats, step end monotonic, new tokens, the step span's context)], with
        # --collect-detailed-traces: only for requests being watched (a step that ends after a request's watch has
        # ended adds nothing), so it holds no more than the requests in flight.
        self.steps_of: dict[str, list] = {}
        self.step_span = None  # the step under way, with --collect-detailed-traces
        if self.metrics:
            registry, labels = telemetry.registry, ["model_name"]

            def histogram(name, doc, buckets):
                return Histogram(name, doc, labels, buckets=buckets, registry=registry).labels(model_name)

            def counter(name, doc):
                return Counter(name, doc, labels, registry=registry).labels(model_name)

            self.scheduler = SchedulerCollector(owner, model_name)
            registry.register(self.scheduler)
            self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
            self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
            self.request_success = Counter(
                "vllm:request_success",
                "Count of successfully processed requests.",
                ["model_name", "finished_reason"],
                registry=registry,
            )
            for reason in FinishReason:  # every reason from 0, as vLLM does: rate() sees a reason's first request
                self.request_success.labels(model_name, str(reason))
            self.ttft = histogram(
                "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
            )
            self.itl = histogram(
                "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
            )
            self.e2e = histogram(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                REQUEST_LATENCY_BUCKETS,
            )
            self.queue_time = histogram(
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                REQUEST_LATENCY_BUCKETS,
            )
            self.prefill_time = histogram(
                "vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                REQUEST_LATENCY_BUCKETS,
            )
            self.decode_time = histogram(
                "vllm:request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                REQUEST_LATENCY_BUCKETS,
            )
            self.iteration_tokens = histogram(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                ITERATION_TOKENS_BUCKETS,
            )

    @property
    def active(self) -> bool:
        return self.metrics or self.telemetry.tracer is not None

    def attach(self, engine) -> None:
        """Follow the engine's steps (the per-step token histogram, detailed traces), when anything needs them."""
        if self.metrics or self.detailed:
            engine.on_step = self.on_step
        if self.detailed:
            engine.on_step_start = self.step_started

    def step_started(self) -> tuple:
        """On the engine thread, before each step (detailed traces): the step's own `engine_step` span, in a trace of
        its own (a step serves many requests: each request's step span links to it). Its context goes with the step
        to the sampler service, whose span of the step is its child."""
        if self.step_span is not None:  # the last step raised
            self.step_span.set_status(Status(StatusCode.ERROR, "the step failed"))
            self.step_span.end()
        self.step_span = self.telemetry.start_span("engine_step")
        return inject(self.step_span)

    def on_step(self, step, outputs) -> None:
        """On the engine thread, after each step."""
        if self.metrics:
            self.iteration_tokens.observe(step.num_tokens)
            self.scheduler.stats_time = time.time()
        if self.detailed:
            end = time.monotonic()
            span, self.step_span = self.step_span, None
            span.set_attributes(step_attributes(step))
            span.end()
            context = span.get_span_context()
            for out in outputs:
                steps = self.steps_of.get(out.request_id)
                if out.new_token_ids and steps is not None:
                    steps.append((step, end, len(out.new_token_ids), context))

    def watch(self, server_span, request_id: str, arrival: float, lora_name: str = "") -> "RequestWatch | None":
        if not self.active:
            return None
        return RequestWatch(self, server_span, request_id, arrival, lora_name)


class RequestWatch:
    """One request in the engine: inter-token latencies as its outputs come, the rest when it finishes (before its
    last output is sent, so a client that has it sees it counted) or when its stream ends otherwise.

    Traced, its `llm_request` span starts at its arrival, under the Generate call's server span, and the request
    carries its context (trace_headers) into the engine: the KV store calls made for it are its children."""

    def __init__(self, owner: EngineTelemetry, server_span, request_id: str, arrival: float, lora_name: str = ""):
        self.owner = owner
        self.request_id = request_id
        self.state = None  # the request's RequestState, once the engine has admitted it
        self.span = None
        if server_span is not None and server_span.is_recording():
            attributes = lora_attributes(lora_name)
            server_span.set_attributes(attributes)
            self.span = owner.telemetry.start_span("llm_request", server_span, start_s=arrival, attributes=attributes)
        self.trace_headers = inject(self.span)
        self.last_token_time: float | None = None
        self.ended = False

    def admitted(self, state) -> None:
        """The engine took the request: its steps are followed (detailed traces) until end()."""
        self.state = state
        if self.owner.detailed:
            for c in state.completions:
                self.owner.steps_of[c.engine_request_id] = []

    def output(self, out) -> None:
        m = out.metrics
        if self.owner.metrics and m.last_token_time is not None and m.last_token_time != self.last_token_time:
            if self.last_token_time is not None:
                self.owner.itl.observe(m.last_token_time - self.last_token_time)
            self.last_token_time = m.last_token_time
        if out.finished:
            self.end()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        state = self.state
        if state is None:  # never admitted (the server span has the error)
            if self.span is not None:
                self.span.end()
            return
        m = state.metrics
        now = time.monotonic()
        end = m.finished_time or now
        prefill = m.prefill_time
        decode = m.decode_time
        reasons = [c.finish_reason or "abort" for c in state.completions]
        owner = self.owner
        if owner.metrics:
            owner.prompt_tokens.inc(len(state.prompt_token_ids) * len(state.completions))
            owner.generation_tokens.inc(m.num_generation_tokens)
            for reason in reasons:
                owner.request_success.labels(owner.model_name, reason).inc()
            owner.e2e.observe(end - m.arrival_time)
            for histogram, value in (
                (owner.ttft, m.time_to_first_token),
                (owner.queue_time, m.time_in_queue),
                (owner.prefill_time, prefill),
                (owner.decode_time, decode),
            ):
                if value is not None:
                    histogram.observe(value)
        steps = [s for c in state.completions for s in owner.steps_of.pop(c.engine_request_id, ())]
        request = self.span
        if request is None:
            return
        telemetry = owner.telemetry
        attributes = {
            "gen_ai.request.id": self.request_id,
            "gen_ai.usage.input_tokens": len(state.prompt_token_ids),
            "gen_ai.usage.output_tokens": m.num_generation_tokens,
            "gen_ai.response.finish_reasons": reasons,
            "gen_ai.request.n": len(state.completions),
            "gen_ai.latency.e2e": end - m.arrival_time,
            "llmmesh.prefix_cache.hit_tokens": state.num_cached_tokens,
            "llmmesh.num_preemptions": m.num_preemptions,
        }
        for key, value in (
            ("time_in_queue", m.time_in_queue),
            ("time_to_first_token", m.time_to_first_token),
            ("time_in_model_prefill", prefill),
            ("time_in_model_decode", decode),
        ):
            if value is not None:
                attributes[f"gen_ai.latency.{key}"] = value
        request.set_attributes(attributes)
        telemetry.span_between("queue", request, m.arrival_time, m.first_scheduled_time)
        prefill_span = telemetry.span_between(
            "prefill",
            request,
            m.first_scheduled_time,
            m.first_token_time,
            {
                "llmmesh.prefix_cache.hit_tokens": state.num_cached_tokens,
                "gen_ai.usage.input_tokens": len(state.prompt_token_ids),
            },
        )
        if prefill_span is not None and state.num_cached_tokens:
            request.add_event(
                "prefix_cache_hit", {"tokens": state.num_cached_tokens}, timestamp=epoch_ns(m.first_scheduled_time)
            )
        telemetry.span_between(
            "decode",
            request,
            m.first_token_time,
            m.last_token_time,
            {"gen_ai.usage.output_tokens": m.num_generation_tokens},
        )
        for start, end, num_tokens in m.encoder_runs:  # images the vision encoder computed for it
            telemetry.span_between("encoder", request, start, end, {"llmmesh.encoder.tokens": num_tokens})
        for when in m.preemption_times:
            request.add_event("preempted", {"llmmesh.num_preemptions": m.num_preemptions}, timestamp=epoch_ns(when))
        for when, name, tokens in m.kv_transfers:  # KV store loads and stores (the KV connector)
            request.add_event(name, {"llmmesh.kv_store.tokens": tokens}, timestamp=epoch_ns(when))
        for step, step_end, num_new, step_context in steps:  # --collect-detailed-traces
            started = step_end - step.schedule_s - step.model_s - step.sample_s - step.update_s
            telemetry.span_between(
                f"step {step.step}",
                request,
                started,
                step_end,
                {**step_attributes(step), "llmmesh.step.new_tokens": num_new},
                links=[Link(step_context)],
            )
        request.end(end_time=epoch_ns(end))
        logger.info(
            "request %s finished (%s): %d prompt + %d generated tokens",
            self.request_id,
            ",".join(reasons),
            len(state.prompt_token_ids),
            m.num_generation_tokens,
        )
