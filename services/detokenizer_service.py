"""llmmesh.v1.Detokenizer: token ids -> text deltas with stop strings, over engine.text.RequestDetokenizer.

One bidirectional stream carries any number of requests: each incoming batch holds items for one or many
requests (start / step / close), and the reply batch holds one result per item, in order. State lives per
stream, so a stream that ends takes its requests with it and cannot touch another stream's.

A request's state lives from `start` until `close` or a step with `finished` (the engine is done). After a
stop string hit the result says finished with stop_str; the caller aborts the engine request and sends
`close`; steps still in flight until then give no text.

A bad item gets a result with `error` set and finished, and its request is dropped; never a stream error, so
on a shared stream the other requests' work goes on.
"""

import argparse
import asyncio
import logging

import grpc

from engine.request import SamplingParams
from engine.text import RequestDetokenizer, Tokenizer
from llmmesh.v1 import detokenizer_pb2, detokenizer_pb2_grpc
from services.tokenizer_service import TextModel, add_text_service_args, check_token_ids, serve_text_service

logger = logging.getLogger("llmmesh.detokenizer")


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

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestDetokenizer] = {}

    def handle(self, batch: detokenizer_pb2.DetokenizeBatch) -> detokenizer_pb2.DetokenizeResultBatch:
        results = []
        for i, item in enumerate(batch.items):
            try:
                results.append(self.handle_item(item, f"items[{i}]"))
            except Exception as e:  # ValueError: bad input; anything else is a bug, but it stays this request's
                if not isinstance(e, ValueError):
                    logger.exception("detokenizing %s failed", item.request_id)
                self.requests.pop(item.request_id, None)
                error = detokenizer_pb2.DetokenizeResult(request_id=item.request_id, finished=True, error=str(e))
                results.append(error)
        return detokenizer_pb2.DetokenizeResultBatch(results=results)

    def handle_item(self, item: detokenizer_pb2.DetokenizeItem, field: str) -> detokenizer_pb2.DetokenizeResult:
        rid = item.request_id
        if not rid:
            raise ValueError(f"{field}.request_id must not be empty")
        kind = item.WhichOneof("kind")
        if kind == "start":
            if rid in self.requests:
                raise ValueError(f"{field}.start: request {rid!r} was already started on this stream")
            start = item.start
            check_token_ids(start.prompt_token_ids, self.tokenizer.vocab_size, f"{field}.start.prompt_token_ids")
            try:
                params = params_from_start(start)
            except ValueError as e:  # SamplingParams' message starts with the field name
                raise ValueError(f"{field}.start.{e}") from None
            self.requests[rid] = RequestDetokenizer(self.tokenizer, list(start.prompt_token_ids), params)
            return detokenizer_pb2.DetokenizeResult(request_id=rid)
        if kind == "close":
            self.requests.pop(rid, None)  # closing twice, or after finished, is fine
            return detokenizer_pb2.DetokenizeResult(request_id=rid, finished=True)
        if kind != "step":
            raise ValueError(f"{field}: set one of start, step or close")
        detok = self.requests.get(rid)
        if detok is None:
            raise ValueError(f"{field}.step: request {rid!r} is not open on this stream (start it first)")
        step = item.step
        check_token_ids(step.token_ids, self.tokenizer.vocab_size, f"{field}.step.token_ids")
        detok.update(list(step.token_ids), step.stop_terminated)
        finished = step.finished or detok.matched_stop is not None
        text = detok.get_next_output_text(finished, delta=True)
        if step.finished:
            del self.requests[rid]
        return detokenizer_pb2.DetokenizeResult(
            request_id=rid,
            text=text,
            finished=finished,
            stop_str=detok.matched_stop or "",
            token_texts=[self.tokenizer.token_text(t) for t in step.text_of_token_ids],
        )


class DetokenizerService(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self):
        self.tokenizer: Tokenizer | None = None  # set once loaded

    async def Detokenize(self, request_iterator, context):
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")
        stream = DetokenizeStream(self.tokenizer)
        async for batch in request_iterator:
            yield stream.handle(batch)


def run_detokenizer(args: argparse.Namespace) -> None:
    service = DetokenizerService()

    def loaded(model: TextModel) -> None:
        service.tokenizer = model.tokenizer

    asyncio.run(serve_text_service(
        "detokenizer", detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name,
        lambda s: detokenizer_pb2_grpc.add_DetokenizerServicer_to_server(service, s), loaded, args,
    ))


def add_subcommands(subparsers) -> None:
    parser = subparsers.add_parser("detokenizer", help="serve llmmesh.v1.Detokenizer (token ids -> text deltas)")
    add_text_service_args(parser, default_port=50053)
    parser.set_defaults(func=run_detokenizer)
