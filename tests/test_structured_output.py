"""Structured output (xgrammar): outputs that match their constraint, and the engine around it unchanged.

- The sampler alone (no model): the grammar's mask is applied before anything can pick a token, and its wire form.
- On SmolLM2: JSON schemas (validated with jsonschema), regex, choice, EBNF and any-JSON outputs, greedy and sampled;
  n > 1 and seeds; a bad constraint refused at admission naming its field; a grammar that fails past admission
  ends its request alone; a request waits in WAITING_FOR_FSM while the others step; chunked prefill, preemption,
  the KV store and the sampler service give the same tokens as the plain engine.
- Through the mesh's gateway and through smg (response_format json_schema over vLLM's engine protocol).
"""

import json
import re
import threading

import grpc
import jsonschema
import pytest
import torch

from conftest import SMOLLM2_BLOCK_BYTES, InProcessService, assert_no_leaks, run_to_completion
from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.request import Request, RequestStatus
from engine.sample.metadata import GrammarBitmask, SamplingMetadata
from engine.sample.sampler import Sampler
from engine.sched.output import ModelRunnerOutput
from llmmesh.v1 import common_pb2, sampler_pb2
from mesh.sampler.remote import RemoteSampler
from mesh.sampler.wire import grammar_bitmask_from_proto, grammar_bitmask_to_proto

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
        "required": ["colour", "bright"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
]
PROMPTS = ["A person, as JSON:", "Describe a colour as JSON:", "Three digits as a JSON list:"]
PHONE = r"\d{3}-\d{4}"
CHOICES = ["yes", "no", "maybe"]
EBNF = 'root ::= "The answer is " ("yes" | "no") "."'
MAX_TOKENS = 40


def constrained(temperature: float = 0.0, **constraint) -> SamplingParams:
    # Sampled at 0.8, an unconstrained JSON object may run past MAX_TOKENS; this seed's draws close every one.
    seed = None if temperature == 0.0 else 4
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(**constraint, disable_any_whitespace=True),
    )


# A mixed batch: the schemas greedy and sampled, the other constraints, and an unconstrained request.
JSON_BATCH = [(PROMPTS[0], 0.0, 0), (PROMPTS[0], 0.8, 0), (PROMPTS[1], 0.8, 1), (PROMPTS[2], 0.0, 2)]
BATCH = [(p, constrained(t, json=SCHEMAS[i])) for p, t, i in JSON_BATCH] + [
    ("My phone number is", constrained(regex=PHONE)),
    ("Is the sky blue?", constrained(0.8, choice=CHOICES)),
    ("Is water wet?", constrained(grammar=EBNF)),
    ("Some JSON:", constrained(0.8, json_object=True)),
    ("Once upon a time", SamplingParams(temperature=0.8, seed=3, max_tokens=8)),
]


def check_outputs(texts: list[str], finish_reasons: list[str]) -> None:
    """Each of BATCH's outputs matches its constraint and ended because its grammar did."""
    for text, (_, _, i) in zip(texts, JSON_BATCH):
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    phone, choice, ebnf, any_json, _ = texts[len(JSON_BATCH) :]
    assert re.fullmatch(PHONE, phone), phone
    assert choice in CHOICES, choice
    assert re.fullmatch(r"The answer is (yes|no)\.", ebnf), ebnf
    assert isinstance(json.loads(any_json), dict), any_json
    assert finish_reasons[:-1] == ["stop"] * (len(BATCH) - 1), finish_reasons


def generate(llm: LLM, batch=BATCH):
    outputs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].text for o in outputs], outputs


# ---- the sampler alone ------------------------------------------------------------------------------------------


def bitmask_allowing(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    """xgrammar's packing: bit t % 32 of word t // 32 is set when token t is allowed."""
    words = [[0] * ((vocab + 31) // 32) for _ in allowed]
    for row, tokens in zip(words, allowed):
        for t in tokens:
            row[t // 32] |= 1 << (t % 32)
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)


def test_the_grammar_mask_comes_before_anything_that_picks_a_token():
    vocab = 70
    torch.manual_seed(0)
    logits = torch.randn(3, vocab) * 5
    params = [
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={5: 100.0}),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.0, seed=1, top_k=3, logprobs=2),
    ]
    requests = [Request(str(i), [1], p) for i, p in enumerate(params)]
    allowed = [[3, 64, 69], [7, 8, 40, 41]]
    grammar = GrammarBitmask([0, 2], bitmask_allowing(allowed, vocab))
    for _ in range(20):
        generators = {2: torch.Generator().manual_seed(1)}
        md = SamplingMetadata.from_requests(requests, generators, vocab, torch.device("cpu"), grammar)
        out = Sampler()(logits.clone(), md)
        tokens = out.sampled_token_ids.tolist()
        # logit_bias cannot bring back token 5, top-k keeps allowed tokens only, and row 1 is untouched.
        assert tokens[0] in allowed[0] and tokens[2] in allowed[1], tokens
        assert tokens[1] == logits[1].argmax().item()
        # Logprobs are of the masked logits (as vLLM's): the top ones are allowed tokens, the others -inf.
        assert set(out.logprobs.token_ids[0, 1:].tolist()) <= set(allowed[0])
        masked = torch.ones(vocab, dtype=torch.bool)
        masked[allowed[0]] = False
        assert torch.isneginf(logits[0].log_softmax(-1).masked_fill(masked, float("-inf"))[masked]).all()


def test_grammar_bitmask_wire_form_round_trips_and_refuses_what_does_not_fit():
    vocab = 70
    grammar = GrammarBitmask([2, 0], bitmask_allowing([[1, 69], [4]], vocab))
    msg = sampler_pb2.SampleStep()
    grammar_bitmask_to_proto(msg, grammar)
    back = grammar_bitmask_from_proto(sampler_pb2.SampleStep.FromString(msg.SerializeToString()), 3, vocab)
    assert back.rows == [2, 0] and torch.equal(back.bitmask, grammar.bitmask)
    assert grammar_bitmask_from_proto(sampler_pb2.SampleStep(), 3, vocab) is None
    for rows, data, field in (([3], msg.grammar_bitmask[:12], "grammar_rows"), ([0, 0], msg.grammar_bitmask, "grammar_rows"),
                              ([0], msg.grammar_bitmask, "grammar_bitmask")):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            grammar_bitmask_from_proto(sampler_pb2.SampleStep(grammar_rows=rows, grammar_bitmask=data), 3, vocab)


def test_structured_outputs_params_name_the_field():
    for kwargs, field in (
        ({}, "structured_outputs"),
        (dict(regex="a", grammar=EBNF), "structured_outputs"),
        (dict(choice=[]), "structured_outputs.choice"),
        (dict(choice=["a", ""]), "structured_outputs.choice"),
        (dict(regex=3), "structured_outputs.regex"),
    ):
        with pytest.raises(ValueError, match=re.escape(field)):
            StructuredOutputsParams(**kwargs)
    assert json.loads(StructuredOutputsParams(json=SCHEMAS[0]).json) == SCHEMAS[0]


# ---- on SmolLM2 ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def reference(llm):
    """BATCH on the plain engine: token ids, texts and finish reasons."""
    tokens, texts, outputs = generate(llm)
    return tokens, texts, [o.outputs[0].finish_reason for o in outputs]


def test_outputs_match_their_constraint_greedy_and_sampled(llm, reference):
    _, texts, finish_reasons = reference
    check_outputs(texts, finish_reasons)
    assert_no_leaks(llm.engine)


def test_n_completions_each_follow_the_grammar(llm):
    params = constrained(0.9, json=SCHEMAS[1]).clone(n=3, seed=5)
    completions = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs
    for c in completions:
        jsonschema.validate(json.loads(c.text), SCHEMAS[1])
    assert len({tuple(c.token_ids) for c in completions}) > 1  # seed, seed + 1, seed + 2: not one draw three times


BAD_CONSTRAINTS = [
    (dict(json="{"), "structured_outputs.json"),
    (dict(json='{"type": "colour"}'), "structured_outputs.json"),
    (dict(regex="(["), "structured_outputs.regex"),
    (dict(grammar="root ::= "), "structured_outputs.grammar"),
    (dict(grammar='start ::= "a"'), "structured_outputs.grammar"),
    (dict(structural_tag="{"), "structured_outputs.structural_tag"),
]


@pytest.mark.parametrize("constraint, field", BAD_CONSTRAINTS, ids=[f for _, f in BAD_CONSTRAINTS])
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(llm, constraint, field):
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=rf"^{re.escape(field)} does not compile: \S"):
        llm.generate(["Hello", "World"], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    assert_no_leaks(llm.engine)  # refused before anything was added


def good_requests() -> list[Request]:
    return [
        Request("plain", [504, 3575, 282, 4649, 314], SamplingParams(temperature=0.8, seed=2, max_tokens=6)),
        Request("phone", [1517, 1004, 2371, 30], constrained(regex=PHONE)),
    ]


def test_a_grammar_that_fails_past_admission_ends_its_request_alone(llm):
    clean, _ = run_to_completion(llm.engine, good_requests())
    # Admission bypassed, as a bug past it would: the compile fails on the engine's grammar thread.
    hostile = Request(
        "hostile", [9703, 2040, 253], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(["))
    )
    tokens, ends = run_to_completion(llm.engine, [*good_requests(), hostile])
    assert {k: v for k, v in tokens.items() if k != "hostile"} == clean
    end = ends["hostile"]
    assert str(end.finish_reason) == "error" and tokens.get("hostile", []) == []
    assert "structured_outputs.regex does not compile" in end.failure.message and end.failure.invalid_input


def test_a_token_the_grammar_rejects_ends_its_request_alone(llm):
    """The mask and the matcher disagreeing (a bug past the mask): the request ends with an error, the others go on."""
    engine = llm.engine
    plain, phone = good_requests()
    engine.add_request(plain)
    engine.add_request(phone)
    phone.structured_output_request.grammar.result(timeout=60)
    so = engine.scheduler.schedule()
    assert set(so.structured_output_request_ids) == {"phone"} and so.grammar_bitmask.shape == (1, 1536)
    letter = llm.tokenizer.encode("x", add_special_tokens=False)[0]  # no digit: the regex cannot take it
    outputs = engine.scheduler.update_from_output(so, ModelRunnerOutput([[letter], [letter]]))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["plain"].new_token_ids == [letter] and not by_id["plain"].finished
    assert str(by_id["phone"].finish_reason) == "error" and by_id["phone"].new_token_ids == []
    assert f"the grammar rejected token {letter}" in by_id["phone"].failure.message
    tokens, _ = run_to_completion(engine, [])
    assert len(tokens["plain"]) == 5


def test_a_compiling_request_waits_while_the_others_step(llm, monkeypatch):
    manager = llm.engine.structured_output_manager
    gate, compile_ = threading.Event(), manager.compile
    monkeypatch.setattr(manager, "compile", lambda params: gate.wait(60) and compile_(params))
    engine = llm.engine
    plain, phone = good_requests()
    engine.add_request(plain)
    engine.add_request(phone)
    tokens = []
    while not plain.is_finished():
        tokens += [t for out in engine.step() if out.request_id == "phone" for t in out.new_token_ids]
    assert phone.status == RequestStatus.WAITING_FOR_FSM and tokens == []
    gate.set()
    done, _ = run_to_completion(engine, [])
    assert re.fullmatch(PHONE, llm.tokenizer.decode(done["phone"]))


def test_chunked_prefill_and_preemption_give_the_same_tokens(reference):
    # 6 blocks of 16 tokens for 9 requests of about 25 tokens each, and prompts prefilled 8 tokens at a time.
    small = LLM(kv_cache_memory=str(6 * SMOLLM2_BLOCK_BYTES), max_num_batched_tokens=8)
    tokens, _, _ = generate(small)
    assert tokens == reference[0]
    assert small.engine.scheduler.num_preemptions > 0
    assert_no_leaks(small.engine)


def test_the_kv_store_gives_the_same_tokens(reference, tmp_path):
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    stored = LLM(kv_cache_memory="64MiB", kv_transfer_config=json.dumps(config))
    # Each prompt fills a block of its own, so each request loads it from the store.
    long_batch = [(" ".join([p] * 6), sp) for p, sp in [BATCH[1], BATCH[4], BATCH[-1]]]
    first, texts, _ = generate(stored, long_batch)
    jsonschema.validate(json.loads(texts[0]), SCHEMAS[0])
    assert re.fullmatch(PHONE, texts[1]), texts[1]
    while stored.engine.has_unfinished_requests():  # the stores end
        stored.engine.step()
    assert stored.reset_prefix_cache()
    again, _, outputs = generate(stored, long_batch)
    assert again == first
    assert all(any(name == "kv_loaded" for _, name, _ in o.metrics.kv_transfers) for o in outputs)
    stored.engine.shutdown()


def test_the_sampler_service_gives_the_same_tokens(llm, reference):
    runner = llm.engine.worker.model_runner
    local = runner.sampler
    with InProcessService("sampler") as sampler:
        runner.sampler = RemoteSampler(sampler.address, timeout=30)
        try:
            tokens, _, _ = generate(llm)
        finally:
            runner.sampler.close()
            runner.sampler = local
    assert tokens == reference[0]


# ---- through the mesh and through smg --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    from test_interop import InProcessMesh

    m = InProcessMesh(["--kv-cache-memory", "64MiB"])
    yield m
    m.stop()


def test_the_gateway_constrains_and_refuses_naming_the_field(mesh):
    from services.client import collect, generate

    schema = common_pb2.StructuredOutputsParams(json=json.dumps(SCHEMAS[0]), disable_any_whitespace=True)
    result = collect(
        generate(mesh.address, PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=schema)
    )
    jsonschema.validate(json.loads(result.text()), SCHEMAS[0])
    assert result.choice().finish_reason == "stop"
    for constraint, field in (
        (common_pb2.StructuredOutputsParams(regex="(["), "structured_outputs.regex does not compile"),  # the engine's
        (common_pb2.StructuredOutputsParams(choice=common_pb2.Choices()), "sampling_params.structured_outputs.choice"),
        (common_pb2.StructuredOutputsParams(), "sampling_params.structured_outputs"),
    ):
        with pytest.raises(grpc.RpcError) as info:
            collect(generate(mesh.address, "Hi", max_tokens=2, structured_outputs=constraint))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details(), info.value.details()


def test_smg_response_format_json_schema_reaches_the_engine(mesh, tmp_path):
    from test_interop import SmgRouter, http_json, smg_missing

    from engine.models.loader import DEFAULT_MODEL, prepare_model_dir

    reason = smg_missing()
    if reason:
        pytest.skip(reason)
    # smg reaches workers in plaintext only: the engine's VllmEngine on its loopback port for it
    router = SmgRouter([mesh.vllm_addresses["engine"]], prepare_model_dir(DEFAULT_MODEL), tmp_path / "smg.log")
    try:
        model = router.wait_ready()
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Describe a bright colour as JSON."}],
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMAS[1]}},
        }
        reply = http_json(f"{router.url}/v1/chat/completions", body)
    finally:
        router.stop()
    choice = reply["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[1])
    assert choice["finish_reason"] == "stop"
