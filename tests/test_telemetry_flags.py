"""services.telemetry without a mesh: off by default (and then nothing is wrapped), vLLM's flag and variable,
the sampling ratio, and log lines that carry the trace id."""

import logging

import grpc
import pytest

from services import telemetry
from services.cli import build_parser
from services.handler_telemetry import instrument
from services.telemetry import CURRENT_SERVER_SPAN, Telemetry


def args_of(*argv):
    return build_parser().parse_args(["tokenizer", *argv])


def test_off_by_default_wraps_nothing(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    t = Telemetry("tokenizer", args_of())
    assert t.tracer is None and not t.active and t.metrics_port is None
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    assert instrument(handler, "/llmmesh.v1.Tokenizer/Tokenize", t) is handler  # the very same handler
    assert t.start_span("x") is None and telemetry.inject(None) == ()


def test_vllms_flag_and_its_environment_variable(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "collector:4317")
    assert args_of().otlp_traces_endpoint == "collector:4317"
    assert args_of("--otlp-traces-endpoint", "other:4317").otlp_traces_endpoint == "other:4317"
    monkeypatch.setenv("LLMMESH_OTLP_TRACES_ENDPOINT", "ours:4317")
    assert args_of().otlp_traces_endpoint == "ours:4317"
    engine = build_parser().parse_args(["engine", "--collect-detailed-traces"])
    assert engine.collect_detailed_traces == "all"


def test_the_sampling_ratio_is_checked():
    with pytest.raises(ValueError, match="trace-sample-ratio"):
        Telemetry("tokenizer", args_of("--otlp-traces-endpoint", "127.0.0.1:1", "--trace-sample-ratio", "1.5"))


def test_a_sampling_ratio_traces_that_fraction():
    t = Telemetry("gateway", args_of("--otlp-traces-endpoint", "127.0.0.1:1", "--trace-sample-ratio", "0.25"))
    try:
        sampled = sum(t.new_trace("r").get_span_context().trace_flags.sampled for _ in range(4000))
    finally:
        t.shutdown()
    assert 800 <= sampled <= 1200  # 1000 expected; the ratio sampler hashes random trace ids


def test_log_lines_carry_the_trace_id_of_the_request_served():
    t = Telemetry("gateway", args_of("--otlp-traces-endpoint", "127.0.0.1:1"))
    try:
        span = t.new_trace("r")
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (), None)
        token = CURRENT_SERVER_SPAN.set(span)
        try:
            telemetry.TraceIdFilter().filter(record)
        finally:
            CURRENT_SERVER_SPAN.reset(token)
        assert record.trace == f" trace={span.get_span_context().trace_id:032x}"
        telemetry.TraceIdFilter().filter(record)
        assert record.trace == ""
    finally:
        t.shutdown()
