"""Hostile requests for every service of the mesh, and what each must be answered with (tests/test_hostile.py).

A Case is one call: which RPC ("gateway.Generate", "engine.Generate", "vllm.Generate", "tokenizer.TokenizeBatch",
"detokenizer.Detokenize", ...), the request (a message; a list of batches for the detokenizer's stream) and the
outcomes it may get: OK, or (status code name, regex that the details must match: the field's name).
Generators take a seeded random.Random, so a failing case reproduces from the seed.

Imports no service code: only the generated messages and the configured limits.
"""

import math
import random
import re
from dataclasses import dataclass, field

from smg_grpc_proto.generated import vllm_engine_pb2

from engine.limits import RequestLimits
from llmmesh.v1 import common_pb2, detokenizer_pb2, engine_pb2, gateway_pb2, tokenizer_pb2

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
U32_MAX = 2**32 - 1
NAN, INF = math.nan, math.inf
LONG = 10_000  # characters in a "long" string
LIMITS = RequestLimits()  # the defaults the mesh runs with

OK = "OK"
# Codes a service may answer a hostile request with (CANCELLED only where the client cancelled).
ALLOWED_CODES = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "NOT_FOUND"}
STREAMING = {"gateway.Generate", "gateway.Chat", "engine.Generate", "vllm.Generate", "detokenizer.Detokenize"}


def fieldname(name: str) -> str:
    """A regex for a field's name as a word: `stop` matches "stop[3] is ..." but not "stop_token_ids"."""
    return rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])"


def bad(*names: str, code: str = "INVALID_ARGUMENT") -> tuple[str, str]:
    """The outcome `code` with details naming one of the fields."""
    return (code, "|".join(fieldname(n) for n in names))


ROLE = ("INVALID_ARGUMENT", r"messages\[\d+\]\.role")  # names messages[i].role
NOT_FOUND = ("NOT_FOUND", None)
DEADLINE = ("DEADLINE_EXCEEDED", None)


@dataclass
class Case:
    label: str  # what is hostile about it, without the random parts (failures are grouped by it)
    rpc: str
    request: object
    expect: frozenset  # OK and/or (code, details regex or None)
    timeout: float = 120.0  # a hang shows as DEADLINE_EXCEEDED, which fails unless expected
    n: int = 1  # completions an OK answer must hold (Generate / Chat)

    def summary(self, limit: int = 600) -> str:
        text = self.request.hex() if isinstance(self.request, bytes) else repr_request(self.request)
        return f"{self.rpc} [{self.label}] {text[:limit]}{'...' if len(text) > limit else ''}"


def repr_request(request) -> str:
    if isinstance(request, list):
        return "[" + ", ".join(repr_request(r) for r in request[:4]) + (", ..." if len(request) > 4 else "") + "]"
    # Long repeated fields and strings shortened: the shape is what matters.
    text = str(request).replace("\n", " ")
    return re.sub(r"(.)\1{40,}", lambda m: f"{m.group(1)}*{len(m.group(0))}", text)


def outcomes(*items) -> frozenset:
    return frozenset(items)


# ---- mutations of one field --------------------------------------------------------------------------


@dataclass
class Mutation:
    label: str
    apply: object  # fn(message) -> None
    expect: frozenset
    slow: bool = False  # valid but may run long: sent with a short deadline, DEADLINE_EXCEEDED allowed

    @property
    def field(self) -> str:
        return re.match(r"[a-z_]*", self.label).group()


def _set(name, value):
    def apply(msg):
        setattr(msg, name, value)

    return apply


def _structured(**constraint):
    def apply(msg):
        msg.structured_outputs.SetInParent()
        msg.structured_outputs.MergeFrom(common_pb2.StructuredOutputsParams(**constraint))

    return apply


def _extend(name, values):
    def apply(msg):
        getattr(msg, name).extend(values)

    return apply


def _update(name, mapping):
    def apply(msg):
        getattr(msg, name).update(mapping)

    return apply


def sampling_mutations(vocab: int, max_model_len: int, max_logprobs: int, vllm: bool = False) -> list[Mutation]:
    """One bad, extreme or odd value in one field of SamplingParams (ours, or vLLM's with vllm=True)."""
    m: list[Mutation] = []

    def add(label, apply, *expect, slow=False):
        m.append(Mutation(label, apply, outcomes(*expect), slow))

    floats = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
    for name in floats:
        for value in (NAN, INF, -INF):
            add(f"{name}={value}", _set(name, value), bad(name))
    big = 3e38 if vllm else 1e308  # vLLM's are float32
    add("temperature=-1", _set("temperature", -1.0), bad("temperature"))
    add("temperature=huge", _set("temperature", big), OK, bad("temperature"))
    add("temperature=0", _set("temperature", 0.0), OK)
    add("temperature=tiny", _set("temperature", 1e-30), OK, bad("temperature"))
    add("top_p=-1", _set("top_p", -1.0), bad("top_p"))
    add("top_p=1.5", _set("top_p", 1.5), bad("top_p"))
    add("top_p=tiny", _set("top_p", 1e-30), OK, bad("top_p"))
    if not vllm:  # vLLM's proto reads 0 as unset
        add("top_p=0", _set("top_p", 0.0), bad("top_p"))
        add("repetition_penalty=0", _set("repetition_penalty", 0.0), bad("repetition_penalty"))
    add("min_p=-0.5", _set("min_p", -0.5), bad("min_p"))
    add("min_p=1.5", _set("min_p", 1.5), bad("min_p"))
    add("min_p=1", _set("min_p", 1.0), OK)
    for name in ("presence_penalty", "frequency_penalty"):
        add(f"{name}=2.5", _set(name, 2.5), bad(name))
        add(f"{name}=-huge", _set(name, -big), bad(name))
        add(f"{name}=2", _set(name, 2.0), OK)
    add("repetition_penalty=-1", _set("repetition_penalty", -1.0), bad("repetition_penalty"))
    add("repetition_penalty=huge", _set("repetition_penalty", big), OK, bad("repetition_penalty"))
    add("repetition_penalty=tiny", _set("repetition_penalty", 1e-30), OK, bad("repetition_penalty"))

    int_max = U32_MAX if vllm else I32_MAX
    if vllm:  # unsigned: 0 means the default
        add("n=0", _set("n", 0), OK)
        add("n=uint32 max", _set("n", U32_MAX), bad("n"))
        add("n=int32 max", _set("n", I32_MAX), bad("n"))
    else:
        for value in (0, -1, I32_MIN):
            add(f"n={value}", _set("n", value), bad("n"))
        # n = int32 max is the case known to kill today's gateway: test_extreme_n_last sends it, last.
    add(f"n={LIMITS.max_n + 1}", _set("n", LIMITS.max_n + 1), bad("n"))
    for value in ([] if vllm else [-1, I32_MIN]) + [0, int_max, max_model_len + 1]:
        add(f"max_tokens={value}", _set("max_tokens", value), bad("max_tokens"))
    add("max_tokens=model length", _set("max_tokens", max_model_len), OK, slow=True)
    for value in ([] if vllm else [-1, I32_MIN]) + [int_max, 17]:
        # min_tokens above max_tokens (the base requests ask for at most 4, or 16 by default).
        add(f"min_tokens={value}", _set("min_tokens", value), bad("min_tokens"))
    if not vllm:
        add("top_k=int32 min", _set("top_k", I32_MIN), bad("top_k"))
        add("top_k=-2", _set("top_k", -2), bad("top_k"))
        add("top_k=-1", _set("top_k", -1), OK)
    add("top_k=max", _set("top_k", int_max), OK, bad("top_k"))
    add("top_k=1", _set("top_k", 1), OK)
    seeds = (I32_MIN, I32_MAX, 0, -1) if vllm else (I64_MIN, I64_MAX, 0, -1)
    for value in seeds:
        add(f"seed={value}", _set("seed", value), OK)
    for name in ("logprobs", "prompt_logprobs"):
        for value in (-1, -2, max_logprobs + 1, I32_MAX, I32_MIN):
            add(f"{name}={value}", _set(name, value), bad(name))
        add(f"{name}={max_logprobs}", _set(name, max_logprobs), OK)
        add(f"{name}=0", _set(name, 0), OK)
    for value in (0, -2, I32_MIN):
        add(f"truncate_prompt_tokens={value}", _set("truncate_prompt_tokens", value), bad("truncate_prompt_tokens"))
    add("truncate_prompt_tokens=int32 max", _set("truncate_prompt_tokens", I32_MAX), OK, bad("truncate_prompt_tokens"))
    add("truncate_prompt_tokens=-1", _set("truncate_prompt_tokens", -1), OK)
    add("truncate_prompt_tokens=1", _set("truncate_prompt_tokens", 1), OK)
    if not vllm:  # vLLM's constraint fields are in vllm_cases
        add("structured_outputs unset", _structured(), bad("structured_outputs"))
        add("structured_outputs regex '(['", _structured(regex="(["), bad("regex"))
        add("structured_outputs choice []", _structured(choice=common_pb2.Choices()), bad("choice"))
        add("structured_outputs json '{}'", _structured(json="{}"), OK)
        past = LIMITS.max_structured_output_chars + 1
        add("structured_outputs regex past its limit", _structured(regex="a" * past), bad("regex"))
        choices = common_pb2.Choices(choices=["c" * 1000] * (past // 1000 + 1))
        add("structured_outputs choices past their limit", _structured(choice=choices), bad("choice"))

    bias_keys = [-1, vocab, I32_MAX, I32_MIN]
    for key in bias_keys:
        add(f"logit_bias key={key}", _update("logit_bias", {key: 1.0}), bad("logit_bias"))
    for value in (NAN, INF, -INF):
        add(f"logit_bias value={value}", _update("logit_bias", {5: value}), bad("logit_bias"))
    add("logit_bias value=huge", _update("logit_bias", {5: big, 6: -big}), OK)
    add(
        f"logit_bias {LIMITS.max_logit_bias + 1} entries",
        _update("logit_bias", {t: 0.5 for t in range(LIMITS.max_logit_bias + 1)}),
        bad("logit_bias"),
    )
    add(
        f"logit_bias {LIMITS.max_logit_bias} entries",
        _update("logit_bias", {t: 0.5 for t in range(LIMITS.max_logit_bias)}),
        OK,
    )
    stop_id_bad = [vocab, U32_MAX] if vllm else [-1, vocab, I32_MIN, I32_MAX]
    for value in stop_id_bad:
        add(f"stop_token_ids=[{value}]", _extend("stop_token_ids", [value]), bad("stop_token_ids"))
    add(
        f"stop_token_ids {LIMITS.max_stop_token_ids + 1}",
        _extend("stop_token_ids", [7] * (LIMITS.max_stop_token_ids + 1)),
        bad("stop_token_ids"),
    )
    add("stop_token_ids=[2, 7]", _extend("stop_token_ids", [2, 7]), OK)
    add("stop=['']", _extend("stop", [""]), bad("stop"))
    add("stop=[10,000 chars]", _extend("stop", ["s" * LONG]), bad("stop"))
    add(
        f"stop {LIMITS.max_stop + 1} strings",
        _extend("stop", [f"s{i}" for i in range(LIMITS.max_stop + 1)]),
        bad("stop"),
    )
    add(f"stop [{LIMITS.max_stop_chars} chars]", _extend("stop", ["s" * LIMITS.max_stop_chars]), OK)
    add("stop odd unicode", _extend("stop", ["\x00", "\uffff", "🙂", "\n"]), OK)
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"):
        add(f"{name}=True", _set(name, True), OK)
        add(f"{name}=False", _set(name, False), OK)
    if not vllm:
        for value in (-1, vocab, I32_MAX, I32_MIN):
            add(f"allowed_token_ids=[{value}]", _extend("allowed_token_ids", [value]), bad("allowed_token_ids"))
        add(
            f"allowed_token_ids {LIMITS.max_allowed_token_ids + 1}",
            _extend("allowed_token_ids", [t % vocab for t in range(LIMITS.max_allowed_token_ids + 1)]),
            bad("allowed_token_ids"),
        )
        add("allowed_token_ids=[42, 42]", _extend("allowed_token_ids", [42, 42]), OK)
        add("bad_words=['']", _extend("bad_words", [""]), bad("bad_words"))
        add("bad_words whitespace only", _extend("bad_words", ["\n\n", " "]), bad("bad_words"))
        add("bad_words=[10,000 chars]", _extend("bad_words", ["b" * LONG]), bad("bad_words"))
        add(
            f"bad_words {LIMITS.max_bad_words + 1}",
            _extend("bad_words", [f"w{i}" for i in range(LIMITS.max_bad_words + 1)]),
            bad("bad_words"),
        )
        add("bad_words odd unicode", _extend("bad_words", ["the", "\x00", "🙂🙂"]), OK)
    return m


# ---- the gateway ---------------------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "def f(x):",
    "Once upon a time",
    "1, 2, 3,",
    "Paged attention is",
    "🙂 ü \x00 ok",
]
DUPLICATE_IDS = ["dup-0", "dup-1", "dup-2"]  # reused by many concurrent requests: each must still succeed
ROLES = ["system", "user", "assistant", "tool"]


@dataclass
class Info:
    vocab: int
    max_model_len: int
    max_logprobs: int
    kv_tokens: int  # tokens the KV cache holds
    model: str


def _base_params(rng: random.Random, msg) -> None:
    """Valid, cheap sampling params into msg (common_pb2.SamplingParams): mostly one token, now and then n > 1."""
    msg.max_tokens = rng.choice([1, 1, 1, 2, 4])
    msg.temperature = rng.choice([0.0, 0.0, 0.5, 1.0, 1.3])
    if rng.random() < 0.3:
        msg.top_p = rng.uniform(0.1, 1.0)
    if rng.random() < 0.3:
        msg.top_k = rng.choice([-1, 0, 1, 40])
    if rng.random() < 0.3:
        msg.seed = rng.randint(I64_MIN, I64_MAX)
    if rng.random() < 0.03:
        msg.n = rng.randint(2, 8)
        if rng.random() < 0.5:
            msg.logprobs = rng.randint(0, 5)


def _param_mutations(rng, muts: list[Mutation]) -> list[Mutation]:
    """For a random request: none (a valid request) one time in twenty, else one or two mutations of different
    fields, mostly (90%) ones that must fail (cheap); never a slow one (those are sent once each)."""
    r = rng.random()
    if r < 0.05:
        return []
    failing = [mu for mu in muts if OK not in mu.expect]
    passing = [mu for mu in muts if OK in mu.expect and not mu.slow]
    chosen: list[Mutation] = []
    for _ in range(1 if r < 0.85 else 2):
        mu = rng.choice(failing if rng.random() < 0.9 else passing)
        if all(mu.field != other.field for other in chosen):
            chosen.append(mu)
    return chosen


def _cheap(rng, muts: list[Mutation]) -> Mutation:
    return rng.choice([mu for mu in muts if not mu.slow])


def _add_prompt_mutation(rng, chosen: list[Mutation], muts: list[Mutation]) -> None:
    """A hostile prompt, unless the params truncate it (truncation comes first, which makes many prompts fine)."""
    if not any(mu.field == "truncate_prompt_tokens" for mu in chosen):
        chosen.append(_cheap(rng, muts))


def _combine(chosen: list[Mutation], slow: bool = False) -> tuple[frozenset, bool]:
    """The outcomes a request with these mutations may get: if any mutation must fail, only the failures."""
    slow = slow or any(mu.slow for mu in chosen)
    if not chosen:
        expect = outcomes(OK)
    elif all(OK in mu.expect for mu in chosen):
        expect = frozenset().union(*(mu.expect for mu in chosen))
    else:
        expect = frozenset(o for mu in chosen for o in mu.expect if o != OK)
    if slow:
        expect |= {DEADLINE}
    return expect, slow


def _prompt_mutations(info: Info) -> list[Mutation]:
    m = []

    def add(label, apply, *expect, slow=False):
        m.append(Mutation(label, apply, outcomes(*expect), slow))

    def text(value):
        def apply(req):
            req.text = value

        return apply

    def ids(values):
        def apply(req):
            req.token_ids.ids[:] = values

        return apply

    add("text=''", text(""), bad("prompt"))
    add("no prompt", lambda req: req.ClearField("prompt"), bad("prompt"))
    add("token_ids=[]", ids([]), bad("prompt", "token_ids"))
    for value in (-1, info.vocab, I32_MAX, I32_MIN):
        add(f"token_ids=[{value}]", ids([1, value]), bad("token_ids", "prompt_token_ids"))
    add("token_ids model length", ids([5] * info.max_model_len), bad("token_ids", "prompt_token_ids", "prompt"))
    if info.kv_tokens < info.max_model_len - 1:  # a prompt the model takes but the KV cache never could
        add(
            "token_ids over the KV cache",
            ids([5] * (info.kv_tokens + 1)),
            bad("token_ids", "prompt_token_ids", "prompt"),
        )
    add("text 10,000 chars", text("lorem ipsum " * (LONG // 12)), OK, slow=True)
    # 15,000 tokens: more than the model takes.
    add("text 10,000 odd chars", text("🙂\x00ü\uffff" * (LONG // 4)), bad("prompt_token_ids", "prompt"))
    add("text over max_prompt_chars", text("x" * (LIMITS.max_prompt_chars + 1)), bad("text", "prompt"))
    add("token_ids all special", ids([0, 1, 2]), OK)
    return m


def _request_mutations() -> list[Mutation]:
    m = []

    def add(label, apply, *expect):
        m.append(Mutation(label, apply, outcomes(*expect)))

    add("model unknown", _set("model", "no-such-model"), NOT_FOUND)
    add("model 10,000 chars", _set("model", "m" * LONG), NOT_FOUND)
    add("model odd", _set("model", "\x00🙂"), NOT_FOUND)
    add("request_id 10,000 chars", _set("request_id", "r" * LONG), bad("request_id"))
    add(
        f"request_id {LIMITS.max_id_chars + 1} chars",
        _set("request_id", "r" * (LIMITS.max_id_chars + 1)),
        bad("request_id"),
    )
    add(f"request_id {LIMITS.max_id_chars} chars", _set("request_id", "r" * LIMITS.max_id_chars), OK)
    add("request_id odd", _set("request_id", "\x00 🙂 /0 i_x"), OK)
    add("cache_salt 10,000 chars", _set("cache_salt", "c" * LONG), bad("cache_salt"))
    add("cache_salt odd", _set("cache_salt", "\x00🙂"), OK)
    add("priority=int32 min", _set("priority", I32_MIN), OK)
    add("priority=int32 max", _set("priority", I32_MAX), OK)
    return m


def _chat_mutations() -> list[Mutation]:
    m = []

    def add(label, apply, *expect, slow=False):
        m.append(Mutation(label, apply, outcomes(*expect), slow))

    def messages(msgs):
        def apply(req):
            del req.messages[:]
            req.messages.extend(common_pb2.ChatMessage(role=r, content=c) for r, c in msgs)

        return apply

    add("messages=[]", messages([]), bad("messages"))
    add(f"messages {LIMITS.max_messages + 1}", messages([("user", "hi")] * (LIMITS.max_messages + 1)), bad("messages"))
    for role in ("", "robot", "r" * LONG, "USER", "\x00"):
        add(f"role={role[:10]!r}", messages([("user", "hi"), (role, "x")]), ROLE)
    add("content 10,000 chars", messages([("user", "lorem ipsum " * (LONG // 12))]), OK, slow=True)
    add("content empty", messages([("user", "")]), OK)
    add(
        "content over max_prompt_chars",
        messages([("user", "x" * (LIMITS.max_prompt_chars // 2 + 1))] * 2),
        bad("messages"),
    )
    for template in ("{{ messages }}", "{% for m in messages %}", "{{ raise_exception('x') }}", "t" * LONG):
        add(f"chat_template={template[:16]!r}", _set("chat_template", template), bad("chat_template"))
    add("add_generation_prompt=False", _set("add_generation_prompt", False), OK)
    return m


def gateway_cases(rng: random.Random, info: Info, count: int) -> list[Case]:
    """Every hostile value once (alone, in an otherwise valid request), then random requests up to count:
    Generate and Chat with one or two hostile fields, Tokenize, Detokenize, ListModels. Shuffled."""
    sp_muts = sampling_mutations(info.vocab, info.max_model_len, info.max_logprobs)
    prompt_muts, req_muts, chat_muts = _prompt_mutations(info), _request_mutations(), _chat_mutations()
    texts = text_cases(info, "gateway")
    cases = [_generate_case(rng, sp_muts, [mu]) for mu in sp_muts + prompt_muts + req_muts]
    cases += [_chat_case(rng, sp_muts, [mu]) for mu in chat_muts + req_muts]
    cases += texts
    while len(cases) < count:
        r = rng.random()
        if r < 0.55:
            chosen = _param_mutations(rng, sp_muts)
            if rng.random() < 0.1:
                _add_prompt_mutation(rng, chosen, prompt_muts)
            if rng.random() < 0.08:
                chosen.append(_cheap(rng, req_muts))
            cases.append(_generate_case(rng, sp_muts, chosen, info))
        elif r < 0.8:
            chosen = _param_mutations(rng, sp_muts)
            if rng.random() < 0.2:
                chosen.append(_cheap(rng, chat_muts))
            if rng.random() < 0.08:
                chosen.append(_cheap(rng, req_muts))
            cases.append(_chat_case(rng, sp_muts, chosen))
        else:
            cases.append(rng.choice(texts))
    rng.shuffle(cases)
    return cases


def _generate_case(rng, sp_muts, chosen: list[Mutation], info: Info | None = None) -> Case:
    req = gateway_pb2.GenerateRequest(stream=rng.random() < 0.7)
    if info is None or rng.random() < 0.8:
        req.text = rng.choice(PROMPTS) + " " * rng.randint(0, 1) + str(rng.randint(0, 999))
    else:
        req.token_ids.ids.extend(rng.randrange(info.vocab) for _ in range(rng.randint(1, 12)))
    if rng.random() < 0.2:
        req.request_id = rng.choice(DUPLICATE_IDS)
    if info is not None and rng.random() < 0.1:
        req.model = info.model
    _base_params(rng, req.sampling_params)
    for mu in chosen:
        mu.apply(req.sampling_params if mu in sp_muts else req)
    expect, slow = _combine(chosen)
    n = req.sampling_params.n if req.sampling_params.HasField("n") else 1
    return Case(
        " + ".join(mu.label for mu in chosen) or "valid", "gateway.Generate", req, expect, 3.0 if slow else 120.0, n
    )


def _chat_case(rng, sp_muts, chosen: list[Mutation]) -> Case:
    req = gateway_pb2.ChatRequest(stream=rng.random() < 0.7)
    for _ in range(rng.randint(1, 3)):
        req.messages.add(role=rng.choice(ROLES), content=rng.choice(PROMPTS))
    if rng.random() < 0.2:
        req.request_id = rng.choice(DUPLICATE_IDS)
    _base_params(rng, req.sampling_params)
    for mu in chosen:
        mu.apply(req.sampling_params if mu in sp_muts else req)
    expect, slow = _combine(chosen)
    n = req.sampling_params.n if req.sampling_params.HasField("n") else 1
    return Case(
        " + ".join(mu.label for mu in chosen) or "valid", "gateway.Chat", req, expect, 3.0 if slow else 120.0, n
    )


def text_cases(info: Info, service: str) -> list[Case]:
    """Every hostile Tokenize / Detokenize (and, for the gateway, ListModels) request, once."""
    T, D = tokenizer_pb2.TokenizeRequest, tokenizer_pb2.DetokenizeTextRequest
    chat = tokenizer_pb2.ChatInput
    msg = common_pb2.ChatMessage
    template_field = "chat_template"
    c = []

    def add(label, rpc, request, *expect, timeout=60.0):
        c.append(Case(label, f"{service}.{rpc}", request, outcomes(*expect), timeout))

    add("text", "Tokenize", T(text="hello"), OK)
    add("text ''", "Tokenize", T(text=""), OK)
    add("text 10,000 chars", "Tokenize", T(text="🙂 x\x00" * (LONG // 4)), OK)
    add("text over max_prompt_chars", "Tokenize", T(text="x" * (LIMITS.max_prompt_chars + 1)), bad("text"))
    add("no input", "Tokenize", T(), bad("input"))
    for value in (0, -2, I32_MIN):
        add(
            f"truncate_prompt_tokens={value}",
            "Tokenize",
            T(text="a b c", truncate_prompt_tokens=value),
            bad("truncate_prompt_tokens"),
        )
    add(
        "truncate_prompt_tokens=int32 max",
        "Tokenize",
        T(text="a b c", truncate_prompt_tokens=I32_MAX),
        OK,
        bad("truncate_prompt_tokens"),
    )
    add("truncate_prompt_tokens=-1", "Tokenize", T(text="a b c", truncate_prompt_tokens=-1), OK)
    add("add_special_tokens", "Tokenize", T(text="a", add_special_tokens=True), OK)
    add("chat", "Tokenize", T(chat=chat(messages=[msg(role="user", content="hi")])), OK)
    add("chat no messages", "Tokenize", T(chat=chat()), bad("messages"))
    add(
        f"chat {LIMITS.max_messages + 1} messages",
        "Tokenize",
        T(chat=chat(messages=[msg(role="user", content="hi")] * (LIMITS.max_messages + 1))),
        bad("messages"),
    )
    for role in ("", "robot", "r" * LONG):
        add(f"chat role={role[:10]!r}", "Tokenize", T(chat=chat(messages=[msg(role=role, content="x")])), ROLE)
    for template in ("{{ messages }}", "{% for m in messages %}", "{{ raise_exception('x') }}"):
        add(
            f"chat_template={template[:16]!r}",
            "Tokenize",
            T(chat=chat(messages=[msg(role="user", content="x")], chat_template=template)),
            bad(template_field),
        )
    add(
        "chat add_generation_prompt=False",
        "Tokenize",
        T(chat=chat(messages=[msg(role="user", content="x")], add_generation_prompt=False)),
        OK,
    )

    add("token_ids", "Detokenize", D(token_ids=[1, 2, 3, 400]), OK)
    add("token_ids=[]", "Detokenize", D(), OK)
    add("skip_special_tokens=False", "Detokenize", D(token_ids=[0, 1, 2], skip_special_tokens=False), OK)
    for value in (-1, info.vocab, I32_MAX, I32_MIN):
        add(f"token_ids=[{value}]", "Detokenize", D(token_ids=[5, value]), bad("token_ids"))
    add("token_ids over model length", "Detokenize", D(token_ids=[5] * (info.max_model_len + 1)), bad("token_ids"))
    if service == "gateway":
        add("ListModels", "ListModels", gateway_pb2.ListModelsRequest(), OK)
    else:
        add("GetTokenizerInfo", "GetTokenizerInfo", tokenizer_pb2.GetTokenizerInfoRequest(), OK)
        add("batch empty", "TokenizeBatch", tokenizer_pb2.TokenizeBatchRequest(), OK)
        add(
            f"batch {LIMITS.max_batch}",
            "TokenizeBatch",
            tokenizer_pb2.TokenizeBatchRequest(requests=[T(text=f"x {i}") for i in range(LIMITS.max_batch)]),
            OK,
        )
        for size in (LIMITS.max_batch + 1, 20_000):
            add(
                f"batch {size}",
                "TokenizeBatch",
                tokenizer_pb2.TokenizeBatchRequest(requests=[T(text="x")] * size),
                bad("requests"),
            )
        add(
            "batch with a bad request",
            "TokenizeBatch",
            tokenizer_pb2.TokenizeBatchRequest(requests=[T(text="x"), T(), T(text="y")]),
            ("INVALID_ARGUMENT", r"requests\[1\]"),
        )
        add(
            "batch with a bad chat role",
            "TokenizeBatch",
            tokenizer_pb2.TokenizeBatchRequest(requests=[T(text="x"), T(chat=chat(messages=[msg(role="x")]))]),
            ("INVALID_ARGUMENT", r"requests\[1\]\.chat\.messages\[0\]\.role"),
        )
    return c


# ---- the engine's two protocols -------------------------------------------------------------------------


def engine_cases(rng: random.Random, info: Info, count: int) -> list[Case]:
    """llmmesh.v1.Engine Generate with one or two hostile fields (stop strings allowed here)."""
    sp_muts = sampling_mutations(info.vocab, info.max_model_len, info.max_logprobs)
    m = []

    def add(label, apply, *expect, slow=False):
        m.append(Mutation(label, apply, outcomes(*expect), slow))

    def prompt(ids):
        def apply(req):
            req.prompt_token_ids[:] = ids

        return apply

    add("prompt_token_ids=[]", prompt([]), bad("prompt_token_ids", "prompt"))
    for value in (-1, info.vocab, I32_MAX, I32_MIN):
        add(f"prompt_token_ids=[{value}]", prompt([1, value]), bad("prompt_token_ids"))
    add("prompt_token_ids model length", prompt([5] * info.max_model_len), bad("prompt_token_ids"))
    add("prompt_token_ids over the KV cache", prompt([5] * (info.kv_tokens + 1)), bad("prompt_token_ids"))
    add("request_id 10,000 chars", _set("request_id", "r" * LONG), bad("request_id"))
    add("request_id ''", _set("request_id", ""), OK)
    add("cache_salt 10,000 chars", _set("cache_salt", "c" * LONG), bad("cache_salt"))
    add("priority=int32 min", _set("priority", I32_MIN), OK)
    add("priority=int32 max", _set("priority", I32_MAX), OK)
    return _each_then_random(rng, info, sp_muts, m, count, _engine_case)


def _each_then_random(rng, info, sp_muts, prompt_muts, count, make_case) -> list[Case]:
    """Every mutation once on its own, then random ones with one or two bad fields, up to count, shuffled."""
    cases = [make_case(rng, info, sp_muts, [mu], i) for i, mu in enumerate(sp_muts + prompt_muts)]
    while len(cases) < count:
        chosen = _param_mutations(rng, sp_muts)
        if rng.random() < 0.25:
            _add_prompt_mutation(rng, chosen, prompt_muts)
        cases.append(make_case(rng, info, sp_muts, chosen, len(cases)))
    rng.shuffle(cases)
    return cases


def _engine_case(rng, info, sp_muts, chosen, i) -> Case:
    req = engine_pb2.EngineGenerateRequest(request_id=f"hostile-engine-{i}-{rng.randrange(10**9)}")
    req.prompt_token_ids.extend(rng.randrange(info.vocab) for _ in range(rng.randint(1, 12)))
    _base_params(rng, req.sampling_params)
    for mu in chosen:
        mu.apply(req.sampling_params if mu in sp_muts else req)
    expect, slow = _combine(chosen)
    n = req.sampling_params.n if req.sampling_params.HasField("n") else 1
    return Case(
        " + ".join(mu.label for mu in chosen) or "valid", "engine.Generate", req, expect, 3.0 if slow else 120.0, n
    )


def vllm_cases(rng: random.Random, info: Info, count: int) -> list[Case]:
    """vllm.grpc.engine.VllmEngine Generate with one or two hostile fields."""
    sp_muts = sampling_mutations(info.vocab, info.max_model_len, info.max_logprobs, vllm=True)
    m = []

    def add(label, apply, *expect, slow=False):
        m.append(Mutation(label, apply, outcomes(*expect), slow))

    def ids(values):
        def apply(req):
            req.tokenized.input_ids[:] = values

        return apply

    def text(value):
        def apply(req):
            req.text = value

        return apply

    add("input_ids=[]", ids([]), bad("prompt_token_ids", "prompt", "input_ids"))
    add("no input", lambda req: req.ClearField("input"), bad("prompt_token_ids", "prompt", "input_ids", "input"))
    for value in (info.vocab, I32_MAX, U32_MAX):
        add(f"input_ids=[{value}]", ids([1, value]), bad("prompt_token_ids", "input_ids"))
    add("input_ids model length", ids([5] * info.max_model_len), bad("prompt_token_ids", "input_ids"))
    add("text ''", text(""), OK, bad("prompt_token_ids", "prompt", "text"))
    add("text 10,000 chars", text("lorem ipsum " * (LONG // 12)), OK, slow=True)
    add("text over max_prompt_chars", text("x" * (LIMITS.max_prompt_chars + 1)), bad("text"))
    add("request_id 10,000 chars", _set("request_id", "r" * LONG), bad("request_id"))
    add("request_id ''", _set("request_id", ""), OK)

    def constraint(name, value):
        def apply(req):
            setattr(req.sampling_params, name, value)

        return apply

    # A constraint is refused naming StructuredOutputsParams' field (json for json_schema), or it runs.
    add("json_schema '{'", constraint("json_schema", "{"), bad("json_schema", "json"))
    add("json_schema '{}'", constraint("json_schema", "{}"), OK)
    add("regex '(['", constraint("regex", "(["), bad("regex"))
    add("grammar ''", constraint("grammar", ""), bad("grammar"))
    add("choice []", lambda req: req.sampling_params.choice.SetInParent(), bad("choice"))
    add("regex past its limit", constraint("regex", "a" * (LIMITS.max_structured_output_chars + 1)), bad("regex"))
    return _each_then_random(rng, info, sp_muts, m, count, _vllm_case)


def _vllm_case(rng, info, sp_muts, chosen, i) -> Case:
    req = vllm_engine_pb2.GenerateRequest(
        request_id=f"hostile-vllm-{i}-{rng.randrange(10**9)}", stream=rng.random() < 0.7
    )
    req.tokenized.input_ids.extend(rng.randrange(info.vocab) for _ in range(rng.randint(1, 12)))
    sp = req.sampling_params
    sp.max_tokens = rng.choice([1, 1, 1, 2, 4])
    sp.temperature = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.03:
        sp.n = rng.randint(2, 8)
        if rng.random() < 0.5:
            sp.logprobs = rng.randint(0, 5)
    for mu in chosen:
        mu.apply(req.sampling_params if mu in sp_muts else req)
    expect, slow = _combine(chosen)
    return Case(
        " + ".join(mu.label for mu in chosen) or "valid",
        "vllm.Generate",
        req,
        expect,
        3.0 if slow else 120.0,
        sp.n or 1,
    )


# ---- the detokenizer's stream -----------------------------------------------------------------------------


def _start(rid, prompt=(1, 2, 3), **kwargs):
    return detokenizer_pb2.DetokenizeItem(
        request_id=rid, start=detokenizer_pb2.DetokenizeStart(prompt_token_ids=prompt, **kwargs)
    )


def _step(rid, ids=(5, 6), **kwargs):
    return detokenizer_pb2.DetokenizeItem(request_id=rid, step=detokenizer_pb2.DetokenizeStep(token_ids=ids, **kwargs))


def _close(rid):
    return detokenizer_pb2.DetokenizeItem(request_id=rid, close=True)


@dataclass
class DetokItem:
    """One item of a scripted detokenizer stream and the `error` its result may carry: None (no error) or a regex."""

    item: detokenizer_pb2.DetokenizeItem
    error: object = None  # None: must succeed; a regex: the error must match; True: either


@dataclass
class DetokScript:
    """Batches sent in lockstep on one stream; or, with abort set, a stream that must end INVALID_ARGUMENT."""

    label: str
    batches: list[list[DetokItem]] = field(default_factory=list)
    abort: str | None = None  # regex the details of the INVALID_ARGUMENT must match


def detokenizer_scripts(rng: random.Random, info: Info) -> list[DetokScript]:
    v = info.vocab
    err = lambda *names: "|".join(fieldname(n) for n in names)  # noqa: E731
    s = []
    one = lambda label, *items: s.append(DetokScript(label, [list(items)]))  # noqa: E731
    one("start, step, close", DetokItem(_start("a")), DetokItem(_step("a")), DetokItem(_close("a")))
    one(
        "step of an unknown id",
        DetokItem(_step("never-started"), err("request_id", "step")),
        DetokItem(_step("x" * 200), err("request_id", "step")),
    )
    one("close of an unknown id", DetokItem(_close("never-started")), DetokItem(_close("\x00🙂")))
    one("start twice", DetokItem(_start("b")), DetokItem(_start("b"), err("start")), DetokItem(_close("b")))
    one("request_id ''", DetokItem(_start(""), err("request_id")), DetokItem(_step(""), err("request_id")))
    one("request_id 10,000 chars", DetokItem(_start("r" * LONG), err("request_id")))
    one("no kind", DetokItem(detokenizer_pb2.DetokenizeItem(request_id="k"), err("start", "step", "close", "kind")))
    one("huge prompt_token_ids", DetokItem(_start("h", [7] * 200_000)), DetokItem(_step("h")), DetokItem(_close("h")))
    one("oov prompt far back", DetokItem(_start("p", [v] + [7] * 1000), True), DetokItem(_close("p")))
    for value in (-1, v, I32_MAX, I32_MIN):
        one(
            f"prompt_token_ids=[{value}]",
            DetokItem(_start("q", [1, value]), err("prompt_token_ids")),
            DetokItem(_close("q")),
        )
        one(
            f"step token_ids=[{value}]",
            DetokItem(_start("t")),
            DetokItem(_step("t", [5, value]), err("token_ids")),
            DetokItem(_close("t")),
        )
        one(
            f"text_of_token_ids=[{value}]",
            DetokItem(_start("u")),
            DetokItem(_step("u", [5], text_of_token_ids=[value]), err("text_of_token_ids")),
            DetokItem(_close("u")),
        )
    one(
        "step over model length",
        DetokItem(_start("w")),
        DetokItem(_step("w", [5] * (info.max_model_len + 1)), err("token_ids")),
        DetokItem(_close("w")),
    )
    one("stop ''", DetokItem(_start("s1", stop=[""]), err("stop")))
    one("stop 10,000 chars", DetokItem(_start("s2", stop=["s" * LONG]), err("stop")))
    one(
        f"stop {LIMITS.max_stop + 1}",
        DetokItem(_start("s3", stop=[f"s{i}" for i in range(LIMITS.max_stop + 1)]), err("stop")),
    )
    for value in (-1, I32_MIN):
        one(f"min_tokens={value}", DetokItem(_start("m", min_tokens=value), err("min_tokens")))
    one(
        "min_tokens=int32 max",
        DetokItem(_start("m2", min_tokens=I32_MAX), True),
        DetokItem(_step("m2", [5], finished=True), True),
    )
    one(
        "finished then step",
        DetokItem(_start("f")),
        DetokItem(_step("f", [5], finished=True)),
        DetokItem(_step("f"), err("request_id", "step")),
    )
    # Many items per batch: up to the limit they are answered one by one, past it the stream ends.
    full = [DetokItem(_start(f"many-{i}")) for i in range(LIMITS.max_batch // 2)]
    full += [DetokItem(_close(f"many-{i}")) for i in range(LIMITS.max_batch // 2)]
    s.append(DetokScript(f"{LIMITS.max_batch} items in a batch", [full]))
    for size in (LIMITS.max_batch + 1, 5000):
        s.append(
            DetokScript(
                f"{size} items in a batch", [[DetokItem(_close(f"c{i}")) for i in range(size)]], abort=err("items")
            )
        )
    # Open requests on one stream, up to the limit in full batches; one more start is refused.
    limit, size = LIMITS.max_open_requests, LIMITS.max_batch
    opened = DetokScript(f"{limit + 1} open requests on a stream")
    opened.batches = [
        [DetokItem(_start(f"open-{i}", (5,))) for i in range(b, min(b + size, limit))] for b in range(0, limit, size)
    ]
    opened.batches.append([DetokItem(_start("open-one-more", (5,)), err("start"))])
    s.append(opened)
    # A random mix on one stream, over several batches.
    mix = DetokScript("random mix")
    open_ids: set[str] = set()
    for _ in range(8):
        batch = []
        for _ in range(rng.randint(1, 40)):
            rid = f"mix-{rng.randrange(30)}"
            kind = rng.random()
            if kind < 0.3:
                batch.append(
                    DetokItem(
                        _start(rid, [rng.randrange(v) for _ in range(rng.randint(1, 20))]),
                        err("start") if rid in open_ids else None,
                    )
                )
                if rid in open_ids:
                    open_ids.discard(rid)  # a bad item drops its request
                else:
                    open_ids.add(rid)
            elif kind < 0.7:
                ids = [rng.randrange(v) for _ in range(rng.randint(0, 6))]
                bad_id = rng.random() < 0.2
                if bad_id:
                    ids.append(rng.choice([-1, v, I32_MAX]))
                if rid not in open_ids:
                    error = err("request_id", "step")
                else:
                    error = err("token_ids") if bad_id else None
                batch.append(DetokItem(_step(rid, ids), error))
                if bad_id:
                    open_ids.discard(rid)  # a bad item drops its request
            else:
                batch.append(DetokItem(_close(rid)))
                open_ids.discard(rid)
        mix.batches.append(batch)
    s.append(mix)
    return s


def abort_requests() -> list[engine_pb2.AbortRequest]:
    return [
        engine_pb2.AbortRequest(),
        engine_pb2.AbortRequest(request_ids=["", "\x00", "🙂", "r" * LONG, "0_x", "i_0"]),
        engine_pb2.AbortRequest(request_ids=[f"nope-{i}" for i in range(10_000)]),
    ]


def lora_cases() -> list[Case]:
    """Load/UnloadLoraAdapter with empty, huge and bad fields, on the gateway (every engine) and on the engine (which
    must run with --enable-lora): each refused naming the field, and nothing loaded."""
    load, unload = common_pb2.LoadLoraAdapterRequest, common_pb2.UnloadLoraAdapterRequest
    loads = [
        ("empty fields", load(), bad("lora_name", "lora_path")),
        ("no path", load(lora_name="a"), bad("lora_path")),
        ("no name", load(lora_path="/nonexistent"), bad("lora_name")),
        ("huge name", load(lora_name="n" * LONG, lora_path="/nonexistent"), bad("lora_name")),
        ("huge path", load(lora_name="a", lora_path="/" + "p" * LONG), bad("lora_path")),
        ("NUL in the path", load(lora_name="a", lora_path="/tmp/\x00x"), bad("lora_path")),
        ("no such directory", load(lora_name="a", lora_path="/nonexistent/adapter"), bad("lora_path")),
        ("not a PEFT directory", load(lora_name="a", lora_path="/"), bad("lora_path")),
        ("a file, not a directory", load(lora_name="a", lora_path="/etc/hostname"), bad("lora_path")),
        ("odd name", load(lora_name="\x00🙂 ../..", lora_path="/nonexistent"), bad("lora_name", "lora_path")),
    ]
    unloads = [
        ("empty name", unload(), bad("lora_name")),
        ("unknown name", unload(lora_name="nope"), bad("lora_name", code="NOT_FOUND")),
        ("huge name", unload(lora_name="n" * LONG), bad("lora_name", code="NOT_FOUND")),
        ("NUL name", unload(lora_name="\x00"), bad("lora_name", code="NOT_FOUND")),
    ]
    return [
        Case(label, f"{service}.{rpc}", request, outcomes(expected), timeout=60)
        for service in ("gateway", "engine")
        for rpc, items in (("LoadLoraAdapter", loads), ("UnloadLoraAdapter", unloads))
        for label, request, expected in items
    ]


# ---- bytes on the wire ---------------------------------------------------------------------------------

# (service, method path, request class, streaming kind) for every RPC a client can reach.
METHODS = {
    "gateway": [
        ("/llmmesh.v1.Gateway/Generate", gateway_pb2.GenerateRequest, "unary_stream"),
        ("/llmmesh.v1.Gateway/Chat", gateway_pb2.ChatRequest, "unary_stream"),
        ("/llmmesh.v1.Gateway/Tokenize", tokenizer_pb2.TokenizeRequest, "unary_unary"),
        ("/llmmesh.v1.Gateway/Detokenize", tokenizer_pb2.DetokenizeTextRequest, "unary_unary"),
        ("/llmmesh.v1.Gateway/ListModels", gateway_pb2.ListModelsRequest, "unary_unary"),
        ("/llmmesh.v1.Gateway/LoadLoraAdapter", common_pb2.LoadLoraAdapterRequest, "unary_unary"),
        ("/llmmesh.v1.Gateway/UnloadLoraAdapter", common_pb2.UnloadLoraAdapterRequest, "unary_unary"),
    ],
    "engine": [
        ("/llmmesh.v1.Engine/Generate", engine_pb2.EngineGenerateRequest, "unary_stream"),
        ("/llmmesh.v1.Engine/Abort", engine_pb2.AbortRequest, "unary_unary"),
        ("/llmmesh.v1.Engine/GetLoad", engine_pb2.GetLoadRequest, "unary_unary"),
        ("/llmmesh.v1.Engine/LoadLoraAdapter", common_pb2.LoadLoraAdapterRequest, "unary_unary"),
        ("/llmmesh.v1.Engine/UnloadLoraAdapter", common_pb2.UnloadLoraAdapterRequest, "unary_unary"),
        ("/llmmesh.v1.Engine/ListLoraAdapters", engine_pb2.ListLoraAdaptersRequest, "unary_unary"),
        ("/vllm.grpc.engine.VllmEngine/Generate", vllm_engine_pb2.GenerateRequest, "unary_stream"),
        ("/vllm.grpc.engine.VllmEngine/Abort", vllm_engine_pb2.AbortRequest, "unary_unary"),
    ],
    "tokenizer": [
        ("/llmmesh.v1.Tokenizer/Tokenize", tokenizer_pb2.TokenizeRequest, "unary_unary"),
        ("/llmmesh.v1.Tokenizer/TokenizeBatch", tokenizer_pb2.TokenizeBatchRequest, "unary_unary"),
        ("/llmmesh.v1.Tokenizer/Detokenize", tokenizer_pb2.DetokenizeTextRequest, "unary_unary"),
    ],
    "detokenizer": [
        ("/llmmesh.v1.Detokenizer/Detokenize", detokenizer_pb2.DetokenizeBatch, "stream_stream"),
    ],
}


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def int64_in_int32_fields() -> list[tuple[str, bytes]]:
    """GenerateRequests whose int32 SamplingParams fields carry 64-bit varints (no generated client sends these)."""
    out = []
    for number, name in ((1, "n"), (13, "max_tokens"), (4, "top_k"), (21, "logprobs"), (12, "min_tokens")):
        for value in (I64_MAX, I64_MIN, 2**32 + 1):
            params = _field(number, 0, _varint(value))
            if number != 13:
                params += _field(13, 0, _varint(2))  # max_tokens 2
            request = _field(2, 2, _varint(5) + b"Hello") + _field(4, 2, _varint(len(params)) + params)
            out.append((f"{name}={value} as a 64-bit varint", request))
    return out


def garbage(rng: random.Random) -> bytes:
    size = rng.choice([1, 2, 7, 64, 1000, 100_000])
    kind = rng.random()
    if kind < 0.6:
        return rng.randbytes(size)
    if kind < 0.8:  # a plausible start, then noise
        return b"\x0a\xff\xff\xff\xff\x0f" + rng.randbytes(size)
    return b"\xff" * size  # a varint that never ends
