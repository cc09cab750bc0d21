"""Each family's real chat template, carried in its GGUF, through the tokenizer service's chat Tokenize (in-process,
on loopback): the same prompt and ids as transformers' tokenizer from the same file; chat_template_kwargs as vLLM's
(Qwen3's enable_thinking), and a template's own refusal (Gemma 2 on a system message) as INVALID_ARGUMENT."""

import chat_templates
import grpc
import pytest
from test_gguf_families import FAMILIES, served_gguf

from conftest import InProcessService, mesh_channel
from llmmesh.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

CHAT = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "the world is"}]  # fmt: skip


def _chat(messages, **kwargs) -> tokenizer_pb2.TokenizeRequest:
    pb = [common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    template_kwargs = kwargs.pop("chat_template_kwargs", None)
    chat = tokenizer_pb2.ChatInput(messages=pb, **kwargs)
    if template_kwargs is not None:
        chat.chat_template_kwargs.update(template_kwargs)
    return tokenizer_pb2.TokenizeRequest(chat=chat)


def _invalid(call, request) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call(request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    return e.value.details()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_chat_template_through_the_tokenizer_service(tmp_path, monkeypatch, family):
    path, _, ref_tok = served_gguf(tmp_path, monkeypatch, family)

    with InProcessService("tokenizer", ["--model", path]) as service, mesh_channel(service.address) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        reply = stub.Tokenize(_chat(CHAT))
        prompt = ref_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert reply.prompt == prompt and list(reply.token_ids) == ref_tok.encode(prompt, add_special_tokens=False)
        system = [{"role": "system", "content": "Be brief."}, *CHAT]
        if family == "gemma2":
            assert "System role not supported" in _invalid(stub.Tokenize, _chat(system))
        else:
            reply = stub.Tokenize(_chat(system, add_generation_prompt=False))
            assert reply.prompt == ref_tok.apply_chat_template(system, tokenize=False, add_generation_prompt=False)


def test_chat_template_kwargs_reach_the_template():
    """Qwen3's template with enable_thinking off closes an empty think block; on, or unset, it leaves it open."""
    with (
        InProcessService("tokenizer", ["--trust-request-chat-template"]) as service,
        mesh_channel(service.address) as channel,
    ):
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        template = chat_templates.QWEN3
        default = stub.Tokenize(_chat(CHAT, chat_template=template)).prompt
        off = stub.Tokenize(_chat(CHAT, chat_template=template, chat_template_kwargs={"enable_thinking": False}))
        on = stub.Tokenize(_chat(CHAT, chat_template=template, chat_template_kwargs={"enable_thinking": True}))
        assert default.endswith("<|im_start|>assistant\n") and on.prompt == default
        assert off.prompt == default + "<think>\n\n</think>\n\n"
        assert len(off.token_ids) > len(on.token_ids)

        details = _invalid(stub.Tokenize, _chat(CHAT, chat_template_kwargs={"messages": []}))
        assert details.startswith("chat.chat_template_kwargs.messages")
        details = _invalid(stub.Tokenize, _chat(CHAT, chat_template_kwargs={"not a name": 1}))
        assert details.startswith("chat.chat_template_kwargs") and "'not a name'" in details
        batch = tokenizer_pb2.TokenizeBatchRequest(
            requests=[_chat(CHAT), _chat(CHAT, chat_template_kwargs={"add_generation_prompt": False})]
        )
        assert _invalid(stub.TokenizeBatch, batch).startswith("requests[1].chat.chat_template_kwargs")
