"""One request can never fail another: one hostile request in a batch of good ones, for every request field and
every hook, and the good requests' outputs equal a run without it.

- At the engine service (llmmesh.v1.Engine, in process, the real SmolLM2): one case per field of
  EngineGenerateRequest and its SamplingParams, generated from the proto's descriptor (a new field without a case
  fails the test). The hostile request is sent alongside the good batch; it ends INVALID_ARGUMENT naming its field
  (or OK where any value of the field is legal), the good ones' tokens equal a clean run, and the engine is SERVING.
- Per-request work inside a step (sampling settings, output processing), reached with admission bypassed as a bug
  past admission would: the request ends alone with finish_reason "error", in process and on the sampler service.
- Every telemetry hook made to raise: nothing fails, the engine stays SERVING, and each raise is counted.
"""

import threading
import urllib.request

import grpc
import pytest
import torch

from conftest import SERVING, InProcessService, mesh_channel, run_to_completion, wait_for_health
from engine import LLM, SamplingParams
from engine.output_processor import OutputProcessor, RequestOutputKind
from engine.request import Request
from engine.sample.sampler import LogprobsTensors
from engine.sched.output import EngineCoreOutput
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from mesh.sampler.remote import RemoteSampler
from services.engine_service import EngineServicer
from services.engine_telemetry import RequestWatch

MAX_N = 4
VOCAB = 49152
I64_MIN, I32_MAX = -(2**63), 2**31 - 1
MAX_TOKENS = 4
PROMPTS = [[504, 3575, 282, 4649, 314], [1517, 1004, 2371, 30], [9703, 2040, 253, 655, 28, 281, 253]]
# Good requests of several kinds, so a row that leaves the batch cannot shift anyone's settings unnoticed.
GOOD = [
    dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    dict(temperature=0.9, top_k=20, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
    dict(
        temperature=0.0,
        repetition_penalty=1.3,
        logit_bias={13: 2.0},
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        logprobs=2,
    ),
]


def engine_request(i: int, **sampling) -> engine_pb2.EngineGenerateRequest:
    return engine_pb2.EngineGenerateRequest(
        request_id=f"good-{i}", prompt_token_ids=PROMPTS[i], sampling_params=common_pb2.SamplingParams(**sampling)
    )


# field -> (how to make the request hostile, the field the refusal must name; None: any value is legal, it runs)
HOSTILE_REQUEST = {
    "request_id": (lambda r: setattr(r, "request_id", "x" * 100_000), "request_id"),
    "prompt_token_ids": (lambda r: r.prompt_token_ids.append(VOCAB), "prompt_token_ids"),
    "priority": (lambda r: setattr(r, "priority", -I32_MAX), None),
    "cache_salt": (lambda r: setattr(r, "cache_salt", "s" * 100_000), "cache_salt"),
    "sampling_params": (lambda r: setattr(r.sampling_params, "n", 0), "n"),
    "lora_name": (lambda r: setattr(r, "lora_name", "x" * 100_000), "lora_name"),
    "kv_transfer_params": (
        lambda r: setattr(r, "kv_transfer_params", '{"do_remote_decode": "yes"}'),
        "kv_transfer_params",
    ),
    "output_token_ids": (lambda r: r.output_token_ids.append(VOCAB), "output_token_ids"),
    "mm_inputs": (lambda r: r.mm_inputs.add(), "mm_inputs"),  # an image for a text-only model, and an empty one
}
HOSTILE_PARAMS = {
    "n": (MAX_N + 1, "n"),
    "temperature": (float("nan"), "temperature"),
    "top_p": (0.0, "top_p"),
    "top_k": (-5, "top_k"),
    "min_p": (2.0, "min_p"),
    "presence_penalty": (3.0, "presence_penalty"),
    "frequency_penalty": (-3.0, "frequency_penalty"),
    "repetition_penalty": (0.0, "repetition_penalty"),
    "logit_bias": ({VOCAB: 1.0}, "logit_bias"),
    "allowed_token_ids": ([VOCAB + 1], "allowed_token_ids"),
    "bad_words": (["\n\n"], "bad_words"),
    "min_tokens": (MAX_TOKENS + 1, "min_tokens"),
    "max_tokens": (10**9, "max_tokens"),
    "seed": (I64_MIN, None),
    "stop": ([""], "stop"),
    "stop_token_ids": ([-1], "stop_token_ids"),
    "ignore_eos": (False, None),
    "include_stop_str_in_output": (True, None),
    "skip_special_tokens": (False, None),
    "spaces_between_special_tokens": (False, None),
    "logprobs": (10**6, "logprobs"),
    "prompt_logprobs": (-2, "prompt_logprobs"),
    "truncate_prompt_tokens": (0, "truncate_prompt_tokens"),
    "structured_outputs": (common_pb2.StructuredOutputsParams(regex="(["), "structured_outputs.regex"),
}


def hostile_request(field: str) -> tuple[engine_pb2.EngineGenerateRequest, str | None]:
    request = engine_request(0, temperature=0.8, max_tokens=MAX_TOKENS)
    request.request_id = "hostile"
    if field in HOSTILE_REQUEST:
        change, named = HOSTILE_REQUEST[field]
        change(request)
        return request, named
    value, named = HOSTILE_PARAMS[field]
    params = request.sampling_params
    if isinstance(value, dict):
        params.logit_bias.update(value)
    elif isinstance(value, common_pb2.StructuredOutputsParams):
        params.structured_outputs.CopyFrom(value)
    elif isinstance(value, list):
        getattr(params, field).extend(value)
    else:
        setattr(params, field, value)
    if field == "stop_token_ids":
        params.min_tokens = 2
    return request, named


def test_every_field_has_a_hostile_case():
    assert set(HOSTILE_REQUEST) == {f.name for f in engine_pb2.EngineGenerateRequest.DESCRIPTOR.fields}
    assert set(HOSTILE_PARAMS) == {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}


@pytest.fixture(scope="module")
def service():
    flags = ["--kv-cache-memory", "256MiB", "--max-n", MAX_N, "--metrics-port", "0", "--shutdown-timeout", "5"]
    with InProcessService("engine", flags) as service:
        yield service


@pytest.fixture(scope="module")
def stub(service):
    with mesh_channel(service.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


def async_llm(service):
    return next(s for s in service.server.servicers if isinstance(s, EngineServicer)).engine


def generate(stub, request) -> tuple[str, list[int], str]:
    """(status code name, the tokens of completion 0, the error details)."""
    tokens = []
    try:
        for msg in stub.Generate(request, timeout=120):
            for delta in msg.outputs:
                if delta.index == 0:
                    tokens += delta.token_ids
    except grpc.RpcError as e:
        return e.code().name, tokens, e.details()
    return "OK", tokens, ""


def run_batch(stub, extra=None) -> tuple[list[list[int]], tuple | None]:
    """The good requests (and one more) at the same time; each good one's tokens, and the extra one's outcome."""
    requests = [engine_request(i, **params) for i, params in enumerate(GOOD)] + ([extra] if extra else [])
    results = [None] * len(requests)

    def one(i):
        results[i] = generate(stub, requests[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    good = results[: len(GOOD)]
    assert all(code == "OK" for code, _, _ in good), good
    return [tokens for _, tokens, _ in good], (results[-1] if extra else None)


@pytest.fixture(scope="module")
def clean(stub):
    return run_batch(stub)[0]


@pytest.mark.parametrize("field", [*HOSTILE_REQUEST, *HOSTILE_PARAMS])
def test_a_hostile_field_fails_only_its_own_request(service, stub, clean, field):
    request, named = hostile_request(field)
    good, (code, tokens, details) = run_batch(stub, request)
    assert good == clean
    if named is None:
        assert code == "OK" and len(tokens) >= 1, details
    else:
        assert code == "INVALID_ARGUMENT" and named in details, (code, details)
    wait_for_health(service.address, SERVING, timeout=5)


def test_a_telemetry_hook_that_raises_fails_nothing(service, stub, clean, monkeypatch):
    engine = async_llm(service)

    def broken(*_):
        raise RuntimeError("a broken telemetry hook")

    before = engine.hook_errors
    monkeypatch.setattr(engine, "on_step", broken)
    monkeypatch.setattr(engine, "on_step_start", broken)
    for hook in ("admitted", "output", "end"):
        monkeypatch.setattr(RequestWatch, hook, broken)
    assert run_batch(stub)[0] == clean
    # Every hook raised: two per step, and three per request at least.
    assert engine.hook_errors - before >= 2 * MAX_TOKENS + 3 * len(GOOD)
    # ... and counted on /metrics.
    url = f"http://127.0.0.1:{service.server.telemetry.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        scraped = reply.read().decode()
    [line] = [x for x in scraped.splitlines() if x.startswith("llmmesh:telemetry_hook_errors_total{")]
    # (a stream's last hook may still run after the scrape)
    assert before + 2 * MAX_TOKENS + 3 * len(GOOD) <= float(line.split()[-1]) <= engine.hook_errors
    monkeypatch.undo()
    wait_for_health(service.address, SERVING, timeout=5)
    assert run_batch(stub)[0] == clean


# ---- per-request work inside a step, past admission ---------------------------------------------------


def _bad_words_unchecked(p):
    p.bad_words_token_ids = [[]]  # what a whitespace-only bad word tokenized to, before admission refused it


STEP_FAULTS = {
    "bad_words_token_ids": _bad_words_unchecked,
    "logit_bias": lambda p: setattr(p, "logit_bias", {VOCAB + 3: 1.0}),
    "allowed_token_ids": lambda p: setattr(p, "allowed_token_ids", [VOCAB + 1]),
    "stop_token_ids": lambda p: (setattr(p, "stop_token_ids", [-1]), setattr(p, "min_tokens", 3)),
}


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="64MiB")


def run_core(engine, hostile: Request | None = None) -> tuple[dict[str, list[int]], dict]:
    good = [Request(f"good-{i}", PROMPTS[i], SamplingParams(**params)) for i, params in enumerate(GOOD)]
    return run_to_completion(engine, good + ([hostile] if hostile is not None else []))


@pytest.mark.parametrize("where", ["in_process", "sampler_service"])
def test_a_request_whose_sampling_settings_raise_ends_alone(llm, where):
    runner = llm.engine.worker.model_runner
    local = runner.sampler
    sampler = InProcessService("sampler") if where == "sampler_service" else None
    if sampler is not None:
        runner.sampler = RemoteSampler(sampler.address, timeout=30)
    try:
        clean, _ = run_core(llm.engine)
        for name, fault in STEP_FAULTS.items():
            params = SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS)
            fault(params)
            # Its prompt is longer, so it joins the batch a step in, mid-run.
            tokens, ends = run_core(llm.engine, Request("hostile", PROMPTS[2] * 3, params))
            assert {k: v for k, v in tokens.items() if k != "hostile"} == clean, name
            end = ends["hostile"]
            assert str(end.finish_reason) == "error" and tokens.get("hostile", []) == [], name
            assert end.failure.message.startswith("request hostile: sampling failed"), end.failure.message
            # In process the empty bad word breaks an index (the engine's fault); the sampler service refuses it as input.
            expected = where == "sampler_service" or name != "bad_words_token_ids"
            assert end.failure.invalid_input == expected, (name, end.failure)
    finally:
        if sampler is not None:
            runner.sampler.close()
            runner.sampler = local
            sampler.stop()


def test_a_request_whose_output_processing_raises_ends_alone(llm):
    """Detokenizing and stop strings run per request on the engine's outputs: one that raises ends its request
    (finish_reason error, its other completions aborted), and the step's other requests get their outputs."""
    processor = OutputProcessor(llm.tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, stop=["never"])
    processor.add_request("good", None, PROMPTS[0], params, output_kind=RequestOutputKind.DELTA)
    processor.add_request("hostile", None, PROMPTS[1], params.clone(n=2), output_kind=RequestOutputKind.DELTA)
    # Logprobs that name a token other than the one sampled: the logprob lookup of that row raises.
    lp = LogprobsTensors(torch.tensor([[5, 5]]), torch.tensor([[-0.1, -0.1]]), torch.tensor([1]))
    outputs = [
        EngineCoreOutput("good", [5], new_logprobs=lp),
        EngineCoreOutput("0_hostile", [6], new_logprobs=lp),
        EngineCoreOutput("1_hostile", [5], new_logprobs=lp),
    ]
    results, to_abort = processor.process_outputs(outputs)
    by_id = {r.request_id: r for r in results}
    assert by_id["good"].error is None and by_id["good"].outputs[0].token_ids == [5]
    hostile = by_id["hostile"]
    assert hostile.finished and hostile.error.message.startswith("request hostile: output processing failed")
    assert {c.finish_reason for c in hostile.outputs} == {"error"}
    assert to_abort == ["0_hostile", "1_hostile"]  # both completions are still running in the engine
    assert "hostile" not in processor.request_states and "1_hostile" not in processor.parent_of


# ---- nothing grows without bound ----------------------------------------------------------------------


def test_a_kv_event_subscriber_that_falls_behind_loses_its_oldest_batches(service, monkeypatch):
    """A subscriber that never reads holds at most KV_EVENT_QUEUE_SIZE batches; the rest are dropped and counted."""
    import asyncio

    import engine.kv.event_publisher

    engine_ = async_llm(service)
    monkeypatch.setattr(engine.kv.event_publisher, "KV_EVENT_QUEUE_SIZE", 4)

    async def deliver_ten():
        queue = engine_.subscribe_kv_events()
        drops = engine_.kv_event_drops
        try:
            for _ in range(10):
                engine_._deliver(0.0, [], {}, [object()])
            return [queue.get_nowait()[0] for _ in range(queue.qsize())], engine_.kv_event_drops - drops
        finally:
            engine_.unsubscribe_kv_events(queue)

    seqs, dropped = asyncio.run_coroutine_threadsafe(deliver_ten(), service.loop).result(30)
    assert len(seqs) == 4 and seqs == list(range(seqs[0], seqs[0] + 4)) and dropped == 6
