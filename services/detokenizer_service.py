"""llmmesh.v1.Detokenizer: token ids -> text deltas with stop strings, over engine.text.RequestDetokenizer.

One bidirectional stream carries any number of requests: each incoming batch holds items for one or many
requests (start / step / close), and the reply batch holds one result per item, in order. State lives per
stream, so a stream that ends takes its requests with it and cannot touch another stream's.

A request's state lives from `start` until `close` or a step with `finished` (the engine is done). After a
stop string hit the result says finished with stop_str; the caller aborts the engine request and sends
`close`; steps still in flight until then give no text.

A bad item gets a result with `error` set and finished, and its request is dropped; never a stream error, so
on a shared stream the other requests' work goes on. A batch over the configured size is refused whole
(INVALID_ARGUMENT), since answering it item by item would be the allocation the limit is there to stop.
"""

import logging

import grpc

from engine.limits import RequestLimits
from engine.request import SamplingParams
from engine.text import RequestDetokenizer
from engine.text.detokenizer import MAX_PROMPT_CONTEXT
from llmmesh.v1 import detokenizer_pb2, detokenizer_pb2_grpc
from services import config
from services.telemetry import Telemetry, set_error
from services.text_model import TextModel, check_token_ids_in_vocab, serve_text_service, text_service_parser

logger = logging.getLogger("llmmesh.detokenizer")

SERVICE_NAME = detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name


def params_from_start(start: detokenizer_pb2.DetokenizeStart) -> SamplingParams:
    """The decode options as SamplingParams; ValueError naming the field on bad values."""
    return SamplingParams(
        max_tokens=None,  # the engine ends the request; the detokenizer never does on length
        stop=list(start.stop),
        include_stop_str_in_output=start.include_stop_str_in_output,
        skip_special_tokens=start.skip_special_tokens if start.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(
            start.spaces_between_special_tokens if start.HasField("spaces_between_special_tokens") else True
        ),
        min_tokens=start.min_tokens,
    )


class DetokenizeStream:
    """The requests of one stream, by request id."""

    def __init__(self, model: TextModel, limits: RequestLimits, telemetry: Telemetry | None = None):
        self.tokenizer = model.tokenizer
        self.max_tokens = model.max_model_len
        self.limits = limits
        self.requests: dict[str, RequestDetokenizer] = {}
        # Traced requests' spans (their context comes on the start item: the stream is shared), until they end.
        self.telemetry = telemetry if telemetry is not None and telemetry.tracer is not None else None
        self.spans: dict = {}

    def handle(self, batch: detokenizer_pb2.DetokenizeBatch) -> detokenizer_pb2.DetokenizeResultBatch:
        self.limits.check_count("items", len(batch.items), "max_batch")
        results = []
        for i, item in enumerate(batch.items):
            try:
                results.append(self.handle_item(item, f"items[{i}]"))
            except Exception as e:  # ValueError: bad input; anything else is a bug, but it stays this request's
                if not isinstance(e, ValueError):
                    logger.exception("detokenizing %s failed", item.request_id[:256])
                self.requests.pop(item.request_id, None)
                error = detokenizer_pb2.DetokenizeResult(request_id=item.request_id, finished=True, error=str(e))
                results.append(error)
                self.end_span(item.request_id, str(e))
        return detokenizer_pb2.DetokenizeResultBatch(results=results)

    def end_span(self, rid: str, error: str | None = None, **attributes) -> None:
        span = self.spans.pop(rid, None) if self.spans else None
        if span is not None:
            span.set_attributes(attributes)
            if error is not None:
                set_error(span, grpc.StatusCode.INVALID_ARGUMENT, error)
            span.end()

    def handle_item(self, item: detokenizer_pb2.DetokenizeItem, field: str) -> detokenizer_pb2.DetokenizeResult:
        rid = item.request_id
        if not rid:
            raise ValueError(f"{field}.request_id must not be empty")
        self.limits.check_id(f"{field}.request_id", rid)
        kind = item.WhichOneof("kind")
        if kind == "start":
            if rid in self.requests:
                raise ValueError(f"{field}.start: request {rid!r} was already started on this stream")
            if len(self.requests) >= self.limits.max_open_requests:
                raise ValueError(
                    f"{field}.start: this stream already has {len(self.requests)} open requests, its limit "
                    f"(--max-open-requests={self.limits.max_open_requests})"
                )
            start = item.start
            # Only the prompt's tail is read (the decoder starts a few tokens before the output).
            prompt_tail = list(start.prompt_token_ids[-MAX_PROMPT_CONTEXT:])
            check_token_ids_in_vocab(prompt_tail, self.tokenizer.vocab_size, f"{field}.start.prompt_token_ids")
            try:
                params = params_from_start(start)
                self.limits.check_params(params)
            except ValueError as e:  # the message starts with the field name
                raise ValueError(f"{field}.start.{e}") from None
            self.requests[rid] = RequestDetokenizer(self.tokenizer, prompt_tail, params)
            if self.telemetry is not None and start.trace_context:
                span = self.telemetry.server_span("detokenize", start.trace_context.items())
                if span is not None:
                    self.spans[rid] = span
            return detokenizer_pb2.DetokenizeResult(request_id=rid)
        if kind == "close":
            self.requests.pop(rid, None)  # closing twice, or after finished, is fine
            self.end_span(rid, closed=True)
            return detokenizer_pb2.DetokenizeResult(request_id=rid, finished=True)
        if kind != "step":
            raise ValueError(f"{field}: set one of start, step or close")
        detok = self.requests.get(rid)
        if detok is None:
            raise ValueError(f"{field}.step: request {rid[:256]!r} is not open on this stream (start it first)")
        step = item.step
        check_token_ids_in_vocab(step.token_ids, self.tokenizer.vocab_size, f"{field}.step.token_ids", self.max_tokens)
        check_token_ids_in_vocab(step.text_of_token_ids, self.tokenizer.vocab_size, f"{field}.step.text_of_token_ids")
        detok.update(list(step.token_ids), step.stop_terminated)
        finished = step.finished or detok.matched_stop is not None
        text = detok.get_next_output_text(finished, delta=True)
        if step.finished:
            del self.requests[rid]
        if finished:
            self.end_span(
                rid,
                **{"llmmesh.stop_str": detok.matched_stop or "", "gen_ai.usage.output_tokens": detok.num_output_tokens},
            )
        return detokenizer_pb2.DetokenizeResult(
            request_id=rid,
            text=text,
            finished=finished,
            stop_str=detok.matched_stop or "",
            token_texts=[self.tokenizer.token_text(t) for t in step.text_of_token_ids],
        )


class DetokenizerService(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self, limits: RequestLimits):
        self.model: TextModel | None = None  # set once loaded
        self.limits = limits
        self.telemetry: Telemetry | None = None  # the server's (serve_text_service)

    async def Detokenize(self, request_iterator, context):
        if self.model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")
        stream = DetokenizeStream(self.model, self.limits, self.telemetry)
        async for batch in request_iterator:
            try:
                yield stream.handle(batch)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def add_subcommands(subparsers) -> None:
    parser = text_service_parser(subparsers, "detokenizer", "serve llmmesh.v1.Detokenizer (token ids -> text deltas)")

    def run(args):
        service = DetokenizerService(config.limits_from_args(args))
        config.run(
            serve_text_service(
                "detokenizer", SERVICE_NAME, detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, service, args
            ),
            args,
        )

    parser.set_defaults(func=run)
