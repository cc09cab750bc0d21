"""Each family's real chat template through the whole mesh (engine, tokenizer, detokenizer and gateway, served
in-process on a tiny random model of the family) and through smg, the OpenAI-HTTP router in front of the engine: the
prompt ids the engine receives are transformers' apply_chat_template of the same messages with the same tokenizer,
the reply is the engine's greedy output decoded, Qwen3's enable_thinking reaches the template, and a template's own
refusal (Gemma 2 on a system message) is a client error naming it, from both."""

import json
import urllib.error

import chat_templates
import grpc
import pytest
import torch
from test_interop import InProcessMesh, SmgRouter, http_json, smg_missing

from conftest import HFReference, assert_greedy_matches
from engine.async_llm import AsyncLLM
from llmmesh.v1 import common_pb2, gateway_pb2
from services.client import collect, gateway_stub, sampling_params

VOCAB = 512
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, pad_token_id=0)  # fmt: skip
MAX_TOKENS = 8
# Word-level contents ("<i>" is id i), three turns, so every template renders its user and assistant turns.
CHAT = [{"role": "user", "content": "<7> <30> <41>"}, {"role": "assistant", "content": "<12> <5>"},
        {"role": "user", "content": "<99> <3> <250> <8>"}]  # fmt: skip
SYSTEM = [{"role": "system", "content": "<60> <61>"}, *CHAT]


def _family(config_class: str, template: str, specials: list[str], bos: str, eos: str, **config):
    return dict(config_class=config_class, template=template, specials=specials, bos=bos, eos=eos, config=config)


# Each family's special tokens as its tokenizer has them; the role words its template writes are plain words.
FAMILIES = {
    "qwen3": _family(
        "Qwen3Config", chat_templates.QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        bos="<|endoftext|>", eos="<|im_end|>", head_dim=16, tie_word_embeddings=False,
    ),
    "phi3": _family(
        "Phi3Config", chat_templates.PHI3, ["<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        bos="<s>", eos="<|end|>",
    ),
    "gemma2": _family(
        "Gemma2Config", chat_templates.GEMMA2, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>", eos="<end_of_turn>", head_dim=16, sliding_window=16, query_pre_attn_scalar=16,
    ),
    "gemma3": _family(
        "Gemma3TextConfig", chat_templates.GEMMA3, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>", eos="<end_of_turn>", head_dim=16, sliding_window=16, query_pre_attn_scalar=16, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
}  # fmt: skip
ROLE_WORDS = ["system", "user", "assistant", "model"]


def save_chat_tokenizer(path, family: dict) -> dict[str, int]:
    """The word-level tokenizer ("<i>" is id i) with the family's special tokens and role words in place of the last
    ids, and the family's chat template; returns those tokens' ids."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = [*family["specials"], *ROLE_WORDS]
    ids = {word: VOCAB - len(words) + i for i, word in enumerate(words)}
    vocab = {f"<{i}>": i for i in range(VOCAB - len(words))} | ids
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Added tokens, so that the template's "<|im_start|>user" splits before the words do.
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in family["specials"]])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<0>", pad_token="<0>", bos_token=family["bos"], eos_token=family["eos"]
    )
    hf.chat_template = family["template"]
    hf.save_pretrained(path)
    return ids


def save_family_chat_model(path, name: str):
    """The family's tiny model (random weights) beside its chat tokenizer: (transformers model, tokenizer)."""
    import transformers

    family = FAMILIES[name]
    ids = save_chat_tokenizer(path, family)
    config_class = getattr(transformers, family["config_class"])
    special = {"bos_token_id": ids[family["bos"]], "eos_token_id": ids[family["eos"]]}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**{**TINY, **family["config"], **special}))
    model.float().eval().save_pretrained(path)
    return model, transformers.AutoTokenizer.from_pretrained(path)


class Received:
    """The prompt ids each request brings the engine (AsyncLLM.add_request, wrapped as an observer: it runs as it
    is), whoever sends it: our gateway or smg."""

    def __init__(self, monkeypatch):
        self.prompts: list[list[int]] = []
        add_request = AsyncLLM.add_request

        def observed(engine, request_id, prompt_token_ids, *args, **kwargs):
            self.prompts.append(list(prompt_token_ids))
            return add_request(engine, request_id, prompt_token_ids, *args, **kwargs)

        monkeypatch.setattr(AsyncLLM, "add_request", observed)

    def only(self) -> list[int]:
        """The one prompt received since the last call."""
        prompts, self.prompts = self.prompts, []
        assert len(prompts) == 1, prompts
        return prompts[0]


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    """One family's model behind an in-process mesh, and the prompts its engine receives."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    model, tok = save_family_chat_model(path, name)
    with pytest.MonkeyPatch.context() as mp:
        received = Received(mp)
        mp.setenv("LLMMESH_MODEL", str(path))  # the engine's, tokenizer's and detokenizer's --model
        mesh = InProcessMesh(["--kv-cache-memory", "8MiB"])
        try:
            yield dict(name=name, path=path, mesh=mesh, model=model, tok=tok, received=received)
        finally:
            mesh.stop()


GRACE = ["--shutdown-grace-period-secs", "1"]


@pytest.fixture(scope="module")
def smg(served, tmp_path_factory):
    reason = smg_missing()
    if reason:
        pytest.skip(reason)
    engine = served["mesh"].vllm_addresses["engine"]  # smg reaches workers in plaintext only: its loopback port
    # Nothing is in flight when it stops: no grace period to wait out.
    router = SmgRouter([engine], served["path"], tmp_path_factory.mktemp("smg") / "smg.log", GRACE)
    try:
        model = router.wait_ready()
        served["received"].prompts.clear()  # wait_ready's own chat
        yield router, model
    finally:
        router.stop()


def cases(name: str) -> list[tuple[list[dict], dict]]:
    """The chats each family renders (messages, chat_template_kwargs): Gemma 2's refuses a system message."""
    chats = [(CHAT, {})] if name == "gemma2" else [(CHAT, {}), (SYSTEM, {})]
    if name == "qwen3":  # enable_thinking off closes an empty think block after the generation prompt
        chats.append((CHAT, {"enable_thinking": False}))
    return chats


def gateway_chat(address: str, messages: list[dict], template_kwargs: dict | None = None):
    request = gateway_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        sampling_params=sampling_params(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    if template_kwargs is not None:
        request.chat_template_kwargs.update(template_kwargs)
    return collect(gateway_stub(address).Chat(request, timeout=60))


def smg_chat(router, model: str, messages: list[dict], template_kwargs: dict | None = None) -> dict:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    if template_kwargs is not None:
        body["chat_template_kwargs"] = template_kwargs
    return http_json(f"{router.url}/v1/chat/completions", body)


def expected_prompt(tok, messages: list[dict], template_kwargs: dict) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **template_kwargs)
    assert 0 not in ids, tok.convert_ids_to_tokens(ids)  # every word the template writes is in the vocabulary
    return ids


def test_chat_through_the_gateway(served):
    """The engine receives transformers' rendering of the chat; the reply is Hugging Face's greedy continuation of
    it, decoded."""
    tok, received = served["tok"], served["received"]
    reference = HFReference(served["model"])
    renderings = set()
    for messages, template_kwargs in cases(served["name"]):
        reply = gateway_chat(served["mesh"].address, messages, template_kwargs)
        prompt = received.only()
        assert prompt == expected_prompt(tok, messages, template_kwargs), (messages, template_kwargs)
        renderings.add(tuple(prompt))
        tokens = list(reply.choice().token_ids)
        assert len(tokens) == MAX_TOKENS and reply.complete.usage.prompt_tokens == len(prompt)
        assert_greedy_matches(tokens, *reference.greedy(prompt, MAX_TOKENS), served["name"])
        assert reply.text().strip() == tok.decode(tokens, skip_special_tokens=True).strip()
    assert len(renderings) == len(cases(served["name"]))  # the system message and enable_thinking each show


def test_chat_through_smg(served, smg):
    """smg renders the template itself (its own Jinja engine) and sends ids: the engine receives the same ids as
    from transformers, and smg's reply is our gateway's."""
    router, model = smg
    tok, received = served["tok"], served["received"]
    for messages, template_kwargs in cases(served["name"]):
        reply = smg_chat(router, model, messages, template_kwargs or None)
        prompt = received.only()
        assert prompt == expected_prompt(tok, messages, template_kwargs), (messages, template_kwargs)
        ours = gateway_chat(served["mesh"].address, messages, template_kwargs)
        received.only()
        message = reply["choices"][0]["message"]
        # smg reads a Qwen3 model's reply as its reasoning until a </think> comes
        text = message["content"] or message.get("reasoning_content") or ""
        assert text.strip() == ours.text().strip() != ""
        assert reply["usage"]["prompt_tokens"] == len(prompt) and reply["usage"]["completion_tokens"] == MAX_TOKENS


# What each family's template refuses, and the words of its refusal.
REFUSED = {
    "gemma2": (SYSTEM, "System role not supported"),
    "gemma3": ([CHAT[0], CHAT[0]], "Conversation roles must alternate"),
}


def refused(served) -> tuple[list[dict], str]:
    if served["name"] not in REFUSED:
        pytest.skip(f"{served['name']}'s template refuses no chat")
    return REFUSED[served["name"]]


def test_template_refusal_through_the_gateway(served):
    """A chat the family's template raises on: INVALID_ARGUMENT naming the messages, with the template's words; it
    never reaches the engine, and the mesh serves the next chat."""
    messages, words = refused(served)
    with pytest.raises(grpc.RpcError) as e:
        gateway_chat(served["mesh"].address, messages)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert e.value.details().startswith("messages: cannot apply the chat template") and words in e.value.details()
    assert served["received"].prompts == []
    assert gateway_chat(served["mesh"].address, CHAT).text()
    served["received"].only()


def test_template_refusal_through_smg(served, smg):
    """smg renders the template itself: HTTP 400 with the template's words, and nothing sent to the engine."""
    messages, words = refused(served)
    router, model = smg
    with pytest.raises(urllib.error.HTTPError) as e:
        smg_chat(router, model, messages)
    assert e.value.code == 400 and words in json.loads(e.value.read())["error"]["message"]
    assert served["received"].prompts == []
    assert smg_chat(router, model, CHAT)["choices"][0]["finish_reason"] == "length"
    served["received"].only()


def test_bad_template_kwargs_named_by_the_gateway(served):
    """A chat_template_kwargs entry that would stand in for apply_chat_template's own argument is named as the
    ChatRequest's field."""
    with pytest.raises(grpc.RpcError) as e:
        gateway_chat(served["mesh"].address, CHAT, {"add_generation_prompt": False})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("chat_template_kwargs.add_generation_prompt"), e.value.details()
