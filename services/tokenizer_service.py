"""llmmesh.v1.Tokenizer: text and chat messages -> token ids and back, over engine.text.Tokenizer."""

import asyncio

import grpc
from google.protobuf import json_format

from engine.config.utils import add_cli_args
from engine.limits import RequestLimits
from engine.processor import truncate_prompt
from llmmesh.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services import config
from services.settings import ChatTemplateConfig, MediaConfig
from services.text_model import (
    TextModel,
    chat_images,
    check_messages,
    check_token_ids_in_vocab,
    serve_text_service,
    text_service_parser,
)

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name

# What apply_chat_template itself is given; a chat_template_kwargs entry may not stand in for them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "conversation", "chat_template", "add_generation_prompt", "tokenize", "continue_final_message",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def chat_template_kwargs(chat: tokenizer_pb2.ChatInput, field: str) -> dict:
    """A chat's extra template variables (vLLM's chat_template_kwargs); ValueError naming `field` on a bad one."""
    if not chat.HasField("chat_template_kwargs"):
        return {}
    kwargs = json_format.MessageToDict(chat.chat_template_kwargs)
    for name in kwargs:
        if name in _RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{field}.{name}: set by the request's own fields, not a template variable")
        if not name.isidentifier():
            raise ValueError(f"{field}: {name!r} is not a template variable name")
    return kwargs


class TokenizerService(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(
        self,
        limits: RequestLimits,
        trust_request_chat_template: bool = False,
        media: MediaConfig | None = None,
    ):
        self.model: TextModel | None = None  # set once loaded; until then every call answers UNAVAILABLE
        self.limits = limits
        self.trust_request_chat_template = trust_request_chat_template
        self.media = media or MediaConfig()
        self._vision = None  # services.vision.VisionPreprocessor, on the first prompt with images

    def vision(self):
        """A vision-language model's processor (which loads torch: a text model's tokenizer never does)."""
        if self._vision is None:
            from services.vision import VisionPreprocessor

            self._vision = VisionPreprocessor(self.model.model_dir, self.model.config, self.media)
        return self._vision

    def tokenize(self, request: tokenizer_pb2.TokenizeRequest, field: str = "") -> tokenizer_pb2.TokenizeResponse:
        """One request; ValueError naming the field (prefixed with `field`, e.g. requests[2].) on bad input."""
        tok = self.model.tokenizer
        kind = request.WhichOneof("input")
        if kind == "text":
            prompt = request.text
            self.limits.check_chars(f"{field}text", prompt, "max_prompt_chars")
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            images = [(f"{field}images[{i}]", image) for i, image in enumerate(request.images)]
        elif kind == "chat":
            chat = request.chat
            messages = check_messages(chat.messages, self.limits, f"{field}chat.messages")
            if chat.chat_template and not self.trust_request_chat_template:
                raise ValueError(
                    f"{field}chat.chat_template: a request may not bring its own chat template here "
                    "(start the tokenizer with --trust-request-chat-template to allow it); leave it empty for the model's own"
                )
            add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
            kwargs = chat_template_kwargs(chat, f"{field}chat.chat_template_kwargs")
            try:
                prompt = tok.apply_chat_template(messages, chat.chat_template or None, add_generation_prompt, **kwargs)
            except Exception as e:  # noqa: BLE001 (no template, a template that does not parse, or one that raises on the input)
                raise ValueError(f"{field}chat: cannot apply the chat template: {e}") from None
            # The template already holds the special tokens.
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else False
            if request.images:
                raise ValueError(f"{field}images: a chat's images go in its messages' content_parts")
            images = chat_images(chat.messages, f"{field}chat.messages")
        else:
            raise ValueError(f"{field}input must be set: give text or chat")
        if images:
            if request.HasField("truncate_prompt_tokens"):
                raise ValueError(
                    f"{field}truncate_prompt_tokens cannot be used with images: it would cut their placeholders"
                )
            # As the offline LLM: the processor tokenizes the prompt and expands each image's placeholder.
            token_ids, mm_inputs = self.vision()(prompt, images, f"{field}images" if kind == "text" else f"{field}chat")
            return tokenizer_pb2.TokenizeResponse(token_ids=token_ids, prompt=prompt, mm_inputs=mm_inputs)
        token_ids = tok.encode(prompt, add_special_tokens=add_special)
        if request.HasField("truncate_prompt_tokens"):
            keep = request.truncate_prompt_tokens
            if keep < 1 and keep != -1:
                raise ValueError(
                    f"{field}truncate_prompt_tokens must be at least 1, or -1 for the model's maximum length "
                    f"({self.model.max_model_len}); got {keep}"
                )
            token_ids = truncate_prompt(token_ids, keep, self.model.max_model_len)
        return tokenizer_pb2.TokenizeResponse(token_ids=token_ids, prompt=prompt)

    async def _ready(self, context) -> None:
        if self.model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")

    async def Tokenize(self, request, context):
        await self._ready(context)
        try:
            if request.images or any(m.content_parts for m in request.chat.messages):
                # Decoding and preprocessing images takes a while: not on the event loop.
                return await asyncio.to_thread(self.tokenize, request)
            return self.tokenize(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def TokenizeBatch(self, request, context):
        await self._ready(context)
        try:
            self.limits.check_count("requests", len(request.requests), "max_batch")
            # On a worker thread: a batch of long prompts would hold the event loop, and every other call, for
            # as long as it takes.
            responses = await asyncio.to_thread(
                lambda: [self.tokenize(r, f"requests[{i}].") for i, r in enumerate(request.requests)]
            )
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return tokenizer_pb2.TokenizeBatchResponse(responses=responses)

    async def Detokenize(self, request, context):
        await self._ready(context)
        tok = self.model.tokenizer
        try:
            check_token_ids_in_vocab(request.token_ids, tok.vocab_size, max_len=self.model.max_model_len)
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


# ---- the process -------------------------------------------------------------------------------


def add_subcommands(subparsers) -> None:
    parser = text_service_parser(subparsers, "tokenizer", "serve llmmesh.v1.Tokenizer (text and chat -> token ids)")
    add_cli_args(parser, ChatTemplateConfig)
    add_cli_args(parser, MediaConfig)

    def run(args):
        media = config.config_from(MediaConfig, args)
        service = TokenizerService(config.limits_from_args(args), args.trust_request_chat_template, media)
        config.run(
            serve_text_service(
                "tokenizer", SERVICE_NAME, tokenizer_pb2_grpc.add_TokenizerServicer_to_server, service, args
            ),
            args,
        )

    parser.set_defaults(func=run)
