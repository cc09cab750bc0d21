"""What the two text services share: the model's tokenizer and config facts, and checks of their input.

Loads no torch: the text services never need it. Also their life as a process (serve_text_service).
"""

import asyncio
import logging
import time

from engine.config.utils import add_cli_args
from engine.limits import RequestLimits
from engine.models.files import load_config, prepare_text_dir
from engine.text import Tokenizer
from services import config
from services.server import Server
from services.settings import TextModelConfig

logger = logging.getLogger("llmmesh.text")

# The roles a chat message may have, for every service that takes chat messages.
CHAT_ROLES = ("system", "user", "assistant", "tool")


class TextModel:
    """The model's tokenizer plus the few config facts the text services report."""

    def __init__(self, model: str):
        self.model_dir = model_dir = prepare_text_dir(model)
        self.config = config = load_config(model_dir)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        self.max_model_len = config.max_position_embeddings
        hf = self.tokenizer.hf
        # The engine stops on the config's eos ids; the tokenizer's own eos is added in case it differs.
        eos = list(config.eos_token_ids) + [hf.eos_token_id]
        self.eos_token_ids = list(dict.fromkeys(i for i in eos if i is not None))
        self.bos_token_id = config.bos_token_id if config.bos_token_id is not None else hf.bos_token_id


def check_messages(messages, limits: RequestLimits, field: str = "messages") -> list[dict]:
    """Chat messages as dicts for the template; ValueError naming the bad field. A message of content parts has
    its content as a list of {"type": "text", "text"} and {"type": "image"} parts (what chat templates place an
    image token for); chat_images has their images."""
    if not messages:
        raise ValueError(f"{field} must hold at least one message")
    limits.check_count(field, len(messages), "max_messages")
    chars = 0
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            got = f"got {m.role[:64]!r}" if m.role else "it is empty"
            raise ValueError(f"{field}[{i}].role must be one of {', '.join(CHAT_ROLES)}; {got}")
        if m.content and m.content_parts:
            raise ValueError(f"{field}[{i}]: set content or content_parts, not both")
        chars += len(m.content) + sum(len(p.text) for p in m.content_parts)
    if chars > limits.max_prompt_chars:
        raise ValueError(
            f"{field}: the messages hold {chars} characters; at most {limits.max_prompt_chars} are allowed "
            f"(--max-prompt-chars={limits.max_prompt_chars})."
        )
    return [{"role": m.role, "content": message_content(m, f"{field}[{i}]")} for i, m in enumerate(messages)]


def message_content(message, field: str) -> str | list[dict]:
    if not message.content_parts:
        return message.content
    content = []
    for j, part in enumerate(message.content_parts):
        kind = part.WhichOneof("part")
        if kind is None:
            raise ValueError(f"{field}.content_parts[{j}]: set text or image")
        content.append({"type": "text", "text": part.text} if kind == "text" else {"type": "image"})
    return content


def chat_images(messages, field: str = "messages") -> list[tuple[str, object]]:
    """The messages' images in order, each with its field."""
    return [
        (f"{field}[{i}].content_parts[{j}].image", part.image)
        for i, m in enumerate(messages)
        for j, part in enumerate(m.content_parts)
        if part.WhichOneof("part") == "image"
    ]


def check_token_ids_in_vocab(token_ids, vocab_size: int, field: str = "token_ids", max_len: int | None = None) -> None:
    if max_len is not None and len(token_ids) > max_len:
        raise ValueError(f"{field} has {len(token_ids)} ids; at most {max_len} (the model's length) are allowed")
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{field}[{i}] = {t} is not a token id: the vocabulary is [0, {vocab_size})")


async def serve_text_service(name: str, service_name: str, add_servicer_to_server, servicer, args) -> None:
    """The text services' life: start NOT_SERVING, load the model's tokenizer, arm the servicer (its
    `model` attribute), go SERVING, and serve until SIGINT/SIGTERM."""
    server = Server(name, [service_name], args)
    server.add(add_servicer_to_server, servicer)
    servicer.telemetry = server.telemetry
    await server.start()
    t0 = time.perf_counter()
    servicer.model = await asyncio.to_thread(TextModel, args.model)
    logger.info(
        "loaded the tokenizer of %s (%d tokens) in %.1f s",
        args.model,
        servicer.model.tokenizer.vocab_size,
        time.perf_counter() - t0,
    )
    await server.set_serving(True)
    await server.serve_until_stopped()


def text_service_parser(subparsers, name: str, help: str):
    parser = config.service_parser(subparsers, name, help)
    add_cli_args(parser, TextModelConfig)
    config.add_limit_args(parser)
    return parser
