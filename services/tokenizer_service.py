"""llmmesh.v1.Tokenizer: text and chat messages -> token ids and back, over engine.text.Tokenizer.

Also holds what both text services share: their command-line flags and their serve loop.
"""

import argparse
import asyncio
import logging
import os
import time

import grpc

from engine.models.loader import load_config, prepare_model_dir
from engine.text import Tokenizer
from llmmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.grpc_server import Server, wait_for_termination

logger = logging.getLogger("llmmesh.tokenizer")

CHAT_ROLES = ("system", "user", "assistant", "tool")


class TextModel:
    """The model's tokenizer plus the few config facts the text services report."""

    def __init__(self, model: str):
        model_dir = prepare_model_dir(model)
        config = load_config(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        self.max_model_len = config.max_position_embeddings
        hf = self.tokenizer.hf
        # The engine stops on the config's eos ids; the tokenizer's own eos is added in case it differs.
        eos = list(config.eos_token_ids) + [hf.eos_token_id]
        self.eos_token_ids = list(dict.fromkeys(i for i in eos if i is not None))
        self.bos_token_id = config.bos_token_id if config.bos_token_id is not None else hf.bos_token_id


def check_messages(messages, field: str = "messages") -> list[dict]:
    """Chat messages as dicts for the template; ValueError naming the bad field."""
    if not messages:
        raise ValueError(f"{field} must hold at least one message")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            got = f"got {m.role!r}" if m.role else "it is empty"
            raise ValueError(f"{field}[{i}].role must be one of {', '.join(CHAT_ROLES)}; {got}")
    return [{"role": m.role, "content": m.content} for m in messages]


def check_token_ids(token_ids, vocab_size: int, field: str = "token_ids") -> None:
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{field}[{i}] = {t} is not a token id: the vocabulary is [0, {vocab_size})")


class TokenizerService(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self):
        self.model: TextModel | None = None  # set once loaded; until then every call answers UNAVAILABLE

    def tokenize(self, request: tokenizer_pb2.TokenizeRequest, field: str = "") -> tokenizer_pb2.TokenizeResponse:
        """One request; ValueError naming the field (prefixed with `field`, e.g. requests[2].) on bad input."""
        tok = self.model.tokenizer
        kind = request.WhichOneof("input")
        if kind == "text":
            prompt = request.text
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        elif kind == "chat":
            chat = request.chat
            messages = check_messages(chat.messages, f"{field}chat.messages")
            add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
            try:
                prompt = tok.apply_chat_template(messages, chat.chat_template or None, add_generation_prompt)
            except Exception as e:  # no template, a template that does not parse, or one that raises on the input
                raise ValueError(f"{field}chat: cannot apply the chat template: {e}") from None
            # The template already holds the special tokens.
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else False
        else:
            raise ValueError(f"{field}input must be set: give text or chat")
        token_ids = tok.encode(prompt, add_special_tokens=add_special)
        if request.HasField("truncate_prompt_tokens"):
            keep = request.truncate_prompt_tokens
            if keep == -1:
                keep = self.model.max_model_len
            elif keep < 1:
                raise ValueError(
                    f"{field}truncate_prompt_tokens must be at least 1, or -1 for the model's maximum length "
                    f"({self.model.max_model_len}); got {keep}"
                )
            token_ids = token_ids[-keep:]  # the end of the prompt, as vLLM keeps
        return tokenizer_pb2.TokenizeResponse(token_ids=token_ids, prompt=prompt)

    async def _ready(self, context) -> None:
        if self.model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")

    async def Tokenize(self, request, context):
        await self._ready(context)
        try:
            return self.tokenize(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def TokenizeBatch(self, request, context):
        await self._ready(context)
        try:
            responses = [self.tokenize(r, f"requests[{i}].") for i, r in enumerate(request.requests)]
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return tokenizer_pb2.TokenizeBatchResponse(responses=responses)

    async def Detokenize(self, request, context):
        await self._ready(context)
        tok = self.model.tokenizer
        try:
            check_token_ids(request.token_ids, tok.vocab_size)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return tokenizer_pb2.DetokenizeTextResponse(text=tok.decode(request.token_ids, skip_special_tokens=skip))

    async def GetTokenizerInfo(self, request, context):
        await self._ready(context)
        m = self.model
        hf = m.tokenizer.hf
        special = {hf.convert_ids_to_tokens(i): i for i in sorted(m.tokenizer.all_special_ids)}
        return tokenizer_pb2.TokenizerInfo(
            vocab_size=m.tokenizer.vocab_size,
            model_max_length=m.max_model_len,
            eos_token_ids=m.eos_token_ids,
            bos_token_id=m.bos_token_id,
            special_tokens=special,
            has_chat_template=bool(getattr(hf, "chat_template", None)),
        )


# ---------------------------------------------------------------------------------------------- running


def _env(name: str, default, type_=str):
    value = os.environ.get("LLMMESH_" + name.upper())
    return default if value is None else type_(value)


def add_text_service_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """The flags of both text services; each reads its default from LLMMESH_<FLAG_NAME>."""
    parser.add_argument("--host", default=_env("host", "127.0.0.1"), help="address to bind (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=_env("port", default_port, int), help="0: any free port")
    parser.add_argument("--model", default=_env("model", "smollm2-135m-instruct"),
                        help="HF model directory, .gguf file, or smollm2-135m-instruct")
    parser.add_argument("--shutdown-timeout", type=float, default=_env("shutdown_timeout", 10.0, float),
                        help="seconds in-flight calls get after SIGTERM")


async def serve_text_service(name: str, full_service_name: str, add_servicer, on_loaded, args) -> None:
    """Start the server (NOT_SERVING), load the model's tokenizer, go SERVING, print the listening line, and
    serve until SIGINT/SIGTERM. add_servicer(server) registers the servicer; on_loaded(TextModel) arms it."""
    server = Server([full_service_name], args.host, args.port)
    add_servicer(server.server)
    await server.start()
    t0 = time.perf_counter()
    model = await asyncio.to_thread(TextModel, args.model)
    logger.info("loaded the tokenizer of %s (%d tokens) in %.1f s", args.model, model.tokenizer.vocab_size,
                time.perf_counter() - t0)
    on_loaded(model)
    await server.set_serving(True)
    print(f"llmmesh {name} listening on {server.address}", flush=True)
    await wait_for_termination(server, args.shutdown_timeout)


def run_tokenizer(args: argparse.Namespace) -> None:
    service = TokenizerService()

    def loaded(model: TextModel) -> None:
        service.model = model

    asyncio.run(serve_text_service(
        "tokenizer", tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name,
        lambda s: tokenizer_pb2_grpc.add_TokenizerServicer_to_server(service, s), loaded, args,
    ))


def add_subcommands(subparsers) -> None:
    parser = subparsers.add_parser("tokenizer", help="serve llmmesh.v1.Tokenizer (text and chat -> token ids)")
    add_text_service_args(parser, default_port=50052)
    parser.set_defaults(func=run_tokenizer)
