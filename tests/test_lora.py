"""Multi-LoRA serving: PEFT adapters made here (random A and B at several ranks and alphas) against Hugging Face
transformers + PEFT with the adapter merged, in float32; mixed batches; slots churning through the LRU; refusals;
the prefix cache forking by adapter; the shrink/expand kernels against their torch reference."""

import asyncio
import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import HFReference, assert_greedy_matches, assert_no_leaks
from engine import LLM, EngineArgs, LoRARequest, SamplingParams
from engine.async_llm import AsyncLLM
from engine.core import EngineCore
from engine.kv.hashing import extend_block_hashes
from engine.request import Request
from kernels.lora import (
    lora_cpu_kernel,
    lora_expand,
    lora_expand_ref,
    lora_kernel_meta,
    lora_shrink,
    lora_shrink_ref,
)
from random_model import save_random_smollm2_shaped
from test_models import COMMON

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, lora_alpha, target modules, rsLoRA)
ADAPTERS = {
    "all-r8": (8, 16, ALL_MODULES, False),
    "qv-r1": (1, 4, ["q_proj", "v_proj"], False),
    "mlp-r16-rs": (16, 8, ["gate_proj", "up_proj", "down_proj"], True),
    "attn-r4": (4, 32, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "kd-r2": (2, 2, ["k_proj", "down_proj"], False),
}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [300, 12, 12, 480, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
MAX_TOKENS = 12


def make_adapter(base_dir: Path, path: Path, rank: int, alpha: float, targets, rslora=False, seed=0):
    """Save a random PEFT adapter for the model in base_dir; the transformers model with it merged (float32)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
    model = get_peft_model(base, config)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama, its adapters, and the merged transformers model of each."""
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    base_model = save_random_smollm2_shaped(base, **COMMON)
    merged = {}
    for seed, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        merged[name] = make_adapter(base, root / name, rank, alpha, targets, rslora, seed)
    return base, root, base_model, merged


def lora(root: Path, name: str) -> LoRARequest:
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, str(root / name))


def make_llm(base: Path, **kwargs) -> LLM:
    kwargs = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16, **kwargs}
    return LLM(str(base), dtype="float32", kv_cache_memory="4MiB", max_num_seqs=16, **kwargs)


def greedy(llm: LLM, prompts, loras) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_each_adapter_matches_transformers_peft_merged(tiny):
    base, root, base_model, merged = tiny
    llm = make_llm(base)
    for name in ADAPTERS:
        ours = greedy(llm, PROMPTS, lora(root, name))
        for prompt, tokens in zip(PROMPTS, ours):
            reference, logits = HFReference(merged[name]).greedy(prompt, MAX_TOKENS)
            assert_greedy_matches(tokens, reference, logits, label=name)
        # The adapter changes the output: it is really applied.
        assert ours != greedy(llm, PROMPTS, None), name
    assert llm.list_loras() == set(range(1, len(ADAPTERS) + 1))
    assert_no_leaks(llm.engine)


def test_mixed_batch_gives_each_request_its_solo_output(tiny):
    base, root, _, _ = tiny
    llm = make_llm(base)
    names = [None, "all-r8", "qv-r1", "mlp-r16-rs"]
    loras = [None if n is None else lora(root, n) for n in names]
    solo = [greedy(llm, [PROMPTS[0]], lr)[0] for lr in loras]
    mixed = greedy(llm, [PROMPTS[0]] * 4, loras)
    assert mixed == solo
    assert len({tuple(t) for t in solo}) == 4  # four different models
    assert_no_leaks(llm.engine)


def merged_in_dtype(base_dir: Path, adapter_dir: Path, dtype: torch.dtype):
    """The transformers model (float32) with the adapter merged after rounding its A and B to dtype: what slots in
    that dtype compute (the adapters here scale by powers of two, so rounding before or after scaling agrees)."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                weight.copy_(weight.to(dtype).float())
    return model.merge_and_unload().eval()


def test_lora_dtype_holds_the_slots_in_bfloat16(tiny):
    """--lora-dtype bfloat16 on a float32 model: the slots are bfloat16, each adapter agrees with transformers +
    PEFT merged in float32 from its A and B rounded to bfloat16, and a mixed batch gives each request its solo
    output; auto takes the model's dtype; another value is refused naming the flag."""
    base, root, _, _ = tiny
    llm = make_llm(base, lora_dtype="bfloat16")
    names = [None, "all-r8", "mlp-r16-rs", "attn-r4"]
    loras = [None if n is None else lora(root, n) for n in names]
    solo = [greedy(llm, [PROMPTS[2]], lr)[0] for lr in loras]
    for name, tokens in zip(names[1:], solo[1:]):
        reference = HFReference(merged_in_dtype(base, root / name, torch.bfloat16))
        assert_greedy_matches(tokens, *reference.greedy(PROMPTS[2], MAX_TOKENS), label=name)
    assert greedy(llm, [PROMPTS[2]] * 4, loras) == solo
    slots = {w.lora_a.dtype for layer in llm.engine.worker.lora_manager.layers for w in layer.values()}
    assert slots == {torch.bfloat16}
    auto = LLM(str(base), dtype="bfloat16", kv_cache_memory="4MiB", enable_lora=True, max_loras=1)
    assert auto.engine.worker.lora_manager.layers[0]["self_attn.qkv_proj"].lora_b.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"lora_dtype must be one of auto, bfloat16, float16, got 'float32'"):
        EngineArgs(enable_lora=True, lora_dtype="float32")


def test_more_adapters_than_slots_all_complete_and_slots_churn(tiny):
    """Five adapters over two slots: a second wave of requests arrives when the first request ends, so adapters
    that left their slot must come back; at most three adapters stay in host memory."""
    base, root, _, merged = tiny
    llm = make_llm(base, max_loras=2, max_cpu_loras=3)
    engine = llm.engine
    for name in ADAPTERS:
        llm.add_lora(lora(root, name))
    waves = [list(ADAPTERS), list(ADAPTERS)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts, tokens, most_adapters = {}, {}, 0

    def add_wave(wave: int) -> None:
        for i, name in enumerate(waves[wave]):
            request_id = f"{wave}-{name}"
            prompts[request_id] = (PROMPTS[(i + wave) % len(PROMPTS)], name)
            tokens[request_id] = []
            state = llm.output_processor.add_request(request_id, None, prompts[request_id][0], params, 0.0)
            for request in state.engine_requests:
                request.lora_request = lora(root, name)
                engine.add_request(request)

    add_wave(0)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
        if any(out.finished for out in outputs) and len(tokens) == len(ADAPTERS):
            add_wave(1)
        most_adapters = max(most_adapters, len({r.lora_request.lora_int_id for r in engine.scheduler.running}))
    assert most_adapters == 2  # never more adapters in a batch than slots
    manager = engine.worker.lora_manager
    assert manager.num_slot_loads > len(ADAPTERS)  # adapters left their slots and came back
    assert len(manager.cpu_loras) == 3
    for request_id, (prompt, name) in prompts.items():
        reference, logits = HFReference(merged[name]).greedy(prompt, MAX_TOKENS)
        assert_greedy_matches(tokens[request_id], reference, logits, label=request_id)
    llm.output_processor.abort_requests(list(tokens))
    assert_no_leaks(engine)


def test_an_adapter_that_cannot_be_read_again_fails_only_its_requests(tiny, tmp_path):
    """One slot and one adapter in host memory: loading b evicts a, whose directory then goes. a's request ends
    with an error naming its adapter; the base model's and b's requests in the same steps get their solo output, and
    a's blocks (computed as the base model) never serve a later hit."""
    base, root, _, _ = tiny
    shutil.copytree(root / "qv-r1", tmp_path / "gone")
    llm = make_llm(base, max_loras=1, max_cpu_loras=1, block_size=4)
    gone, kept = LoRARequest("gone", 1, str(tmp_path / "gone")), lora(root, "attn-r4")
    llm.add_lora(gone)
    llm.add_lora(kept)  # evicts gone from host memory
    shutil.rmtree(tmp_path / "gone")
    solo = [greedy(llm, [PROMPTS[0]], r)[0] for r in (None, kept)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}] * 3, params, use_tqdm=False, lora_request=[None, gone, kept]
    )
    assert [list(o.outputs[0].token_ids) for o in (outputs[0], outputs[2])] == solo
    failed = outputs[1]
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert "loading its LoRA adapter failed" in failed.error.message and "'gone'" in failed.error.message
    digest = llm.engine.lora_digests[gone.lora_int_id]
    cached = {h for h, _ in llm.engine.kv_cache_manager.block_pool.cached_block_hash_to_block}  # (hash, group)
    manager = llm.engine.kv_cache_manager
    blocks = extend_block_hashes([], PROMPTS[0], manager.block_size, manager.hash_fn, manager.root_hash, None, digest)
    assert blocks and not set(blocks) & cached
    assert_no_leaks(llm.engine)


def write_adapter_config(path: Path, **changes) -> None:
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))


def test_bad_adapters_are_refused_and_the_engine_goes_on(tiny, tmp_path):
    base, root, _, _ = tiny
    llm = make_llm(base, max_lora_rank=8)
    good = lora(root, "all-r8")
    expected = greedy(llm, [PROMPTS[0]], good)

    with pytest.raises(ValueError, match=r"lora_request: unknown LoRA adapter 'nope'; loaded adapters: all-r8"):
        llm.processor.process_lora(LoRARequest("nope", 9, str(root / "all-r8")))
    with pytest.raises(ValueError, match=r"rank 16 is above --max-lora-rank 8"):
        llm.add_lora(lora(root, "mlp-r16-rs"))
    # An adapter for lm_head, which we do not serve.
    make_adapter(base, tmp_path / "head", 4, 8, ["lm_head"])
    with pytest.raises(ValueError, match=r"target module\(s\) \['lm_head'\] are not supported"):
        llm.add_lora(LoRARequest("head", 20, str(tmp_path / "head")))
    # An adapter made for another base model: wider layers.
    other = tmp_path / "other-base"
    save_random_smollm2_shaped(other, **{**COMMON, "hidden_size": 32})
    make_adapter(other, tmp_path / "other", 4, 8, ["q_proj"])
    with pytest.raises(
        ValueError, match=r"has shape \((4, 32|32, 4)\), expected \((4, 64|64, 4)\) .*another base model"
    ):
        llm.add_lora(LoRARequest("other", 21, str(tmp_path / "other")))
    with pytest.raises(ValueError, match=r"adapter_config.json does not exist"):
        llm.add_lora(LoRARequest("missing", 22, str(tmp_path / "nowhere")))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"'broken': adapter_config.json is not readable JSON"):
        llm.add_lora(LoRARequest("broken", 23, str(broken)))
    with pytest.raises(ValueError, match=r"lora_int_id 1 is taken"):
        llm.add_lora(LoRARequest("same-id", 1, str(root / "qv-r1")))
    with pytest.raises(ValueError, match=r"lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, str(root / "qv-r1"))

    # Unloading while a request uses it is refused; after it ends, unloading works.
    engine = llm.engine
    state = llm.output_processor.add_request("busy", None, PROMPTS[0], SamplingParams(max_tokens=2), 0.0)
    state.engine_requests[0].lora_request = good
    engine.add_request(state.engine_requests[0])
    with pytest.raises(ValueError, match=r"'all-r8' has 1 request\(s\) in flight"):
        llm.remove_lora("all-r8")
    while engine.has_unfinished_requests():
        engine.step()
    llm.output_processor.abort_requests(["busy"])
    assert llm.list_loras() == {1}
    assert greedy(llm, [PROMPTS[0]], good) == expected  # the engine served on, the adapter intact
    assert llm.remove_lora("all-r8") and not llm.remove_lora("all-r8")
    assert llm.list_loras() == set() and llm.lora_registry == {}
    with pytest.raises(ValueError, match=r"is not loaded"):
        state = llm.output_processor.add_request("late", None, PROMPTS[0], SamplingParams(max_tokens=2), 0.0)
        state.engine_requests[0].lora_request = good
        engine.add_request(state.engine_requests[0])
    assert_no_leaks(engine)


def test_lora_modules_at_start_and_off_without_enable_lora(tiny):
    base, root, _, merged = tiny
    llm = make_llm(base, lora_modules=[f"qv={root / 'qv-r1'}", f"kd={root / 'kd-r2'}"])
    assert llm.lora_registry == {
        "qv": LoRARequest("qv", 1, str(root / "qv-r1")),
        "kd": LoRARequest("kd", 2, str(root / "kd-r2")),
    }
    tokens = greedy(llm, [PROMPTS[1]], llm.lora_registry["kd"])[0]
    assert_greedy_matches(tokens, *HFReference(merged["kd-r2"]).greedy(PROMPTS[1], MAX_TOKENS), label="kd")
    plain = LLM(str(base), dtype="float32", kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match=r"lora_request: this engine serves no LoRA adapters"):
        plain.processor.process_lora(lora(root, "qv-r1"))
    with pytest.raises(ValueError, match=r"need an engine started with --enable-lora"):
        plain.add_lora(lora(root, "qv-r1"))


def test_engine_info_is_replaced_when_adapters_change(tiny):
    """The services' snapshot: a new EngineInfo once an adapter is loaded or removed; the old one stays as it was."""
    base, root, _, _ = tiny
    llm = make_llm(base)
    engine = llm.engine
    empty = engine.info
    assert engine.update_info() is empty and not empty.lora_adapters and empty.enable_lora
    qv = lora(root, "qv-r1")
    llm.add_lora(qv)
    loaded = engine.update_info()
    assert loaded is not empty and not empty.lora_adapters
    assert dict(loaded.lora_adapters) == {"qv-r1": qv}
    assert loaded.lora_digests[qv.lora_int_id] == engine.lora_digests[qv.lora_int_id]
    with pytest.raises(AttributeError):
        loaded.max_loras = 1  # frozen
    llm.remove_lora("qv-r1")
    assert not engine.update_info().lora_adapters and loaded.lora_adapters


def test_tensor_parallel_adapters_give_the_single_device_output(tiny):
    """Two ranks, each with its part of every adapter (B by output rows in the column-parallel q/k/v and gate/up,
    A by input columns in the row-parallel o and down): a batch mixing the base model and two adapters is greedy
    token-identical to one device. Adapters load and unload on every rank, and a refused one on none."""
    base, root, _, _ = tiny
    names = [None, "all-r8", "mlp-r16-rs", "all-r8"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {}
    for size in (1, 2):
        args = EngineArgs(
            model=str(base), dtype="float32", kv_cache_memory="4MiB", enable_lora=True, max_loras=2,
            max_lora_rank=16, tensor_parallel_size=size,
        )  # fmt: skip
        engine = EngineCore(args)
        try:
            for name in ("all-r8", "mlp-r16-rs", "attn-r4"):
                engine.add_lora(lora(root, name))
            assert engine.remove_lora("attn-r4")
            with pytest.raises(ValueError, match="does not exist"):
                engine.add_lora(LoRARequest("gone", 9, str(root / "no-such-adapter")))
            assert engine.list_loras() == {1, 3}
            for i, (prompt, name) in enumerate(zip(PROMPTS + PROMPTS[:1], names)):
                engine.add_request(Request(str(i), prompt, params.clone(), lora_request=name and lora(root, name)))
            tokens = {str(i): [] for i in range(len(names))}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens[out.request_id] += out.new_token_ids
            outputs[size] = tokens
        finally:
            engine.shutdown()
    assert outputs[2] == outputs[1]
    assert len({tuple(t) for t in outputs[1].values()}) == 4  # the adapters are applied


def test_async_llm_loads_serves_and_unloads_adapters(tiny):
    """The engine service's path: adapters loaded and unloaded on the engine thread between steps; requests name
    loaded adapters only; an unload while one runs is refused and the engine serves on."""
    base, root, _, merged = tiny
    args = EngineArgs(
        model=str(base), dtype="float32", kv_cache_memory="4MiB", enable_lora=True, max_loras=2, max_lora_rank=8
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    adapter = lora(root, "attn-r4")

    async def drain(stream) -> list[int]:
        tokens = []
        async for output in stream:
            tokens += output.outputs[0].token_ids
        return tokens

    async def scenario():
        engine = AsyncLLM(lambda: EngineCore(args))
        await engine.loaded()
        try:
            with pytest.raises(
                ValueError, match=r"lora_request: unknown LoRA adapter 'attn-r4'; loaded adapters: none"
            ):
                engine.add_request("early", PROMPTS[0], params.clone(), lora_request=adapter)
            assert await engine.add_lora(adapter) and not await engine.add_lora(adapter)
            with pytest.raises(ValueError, match=r"rank 16 is above --max-lora-rank 8"):
                await engine.add_lora(lora(root, "mlp-r16-rs"))
            assert engine.list_loras() == {adapter.lora_int_id} and engine.lora_registry == {"attn-r4": adapter}
            stream = engine.add_request("a", PROMPTS[0], params.clone(), lora_request=adapter)
            with pytest.raises(ValueError, match=r"'attn-r4' has 1 request\(s\) in flight"):
                await engine.remove_lora(adapter.lora_int_id)
            tokens = await drain(stream)
            assert await engine.remove_lora("attn-r4") and engine.list_loras() == set()
            return tokens
        finally:
            engine.shutdown()

    tokens = asyncio.run(scenario())
    assert_greedy_matches(tokens, *HFReference(merged["attn-r4"]).greedy(PROMPTS[0], MAX_TOKENS), label="async")


def test_prefix_cache_forks_by_adapter(tiny):
    base, root, _, _ = tiny
    llm = make_llm(base, block_size=4)
    prompt = list(range(10, 30))  # five full blocks
    manager = llm.engine.kv_cache_manager

    def hits(lora_request) -> int:
        before = manager.prefix_cache_stats.hits
        greedy(llm, [prompt], lora_request)
        return manager.prefix_cache_stats.hits - before

    a, b = lora(root, "all-r8"), lora(root, "qv-r1")
    assert hits(a) == 0
    assert hits(a) == 16  # four blocks (the last token always runs)
    assert hits(b) == 0  # another adapter: a's blocks are not b's
    assert hits(None) == 0
    assert hits(None) == 16
    # Three cache entries for the one prompt; the base model's blocks are named as without LoRA.
    cached = {h for h, _ in manager.block_pool.cached_block_hash_to_block}  # (hash, group)
    names = [
        extend_block_hashes([], prompt, 4, manager.hash_fn, manager.root_hash, None, key)
        for key in (None, manager.lora_digests[a.lora_int_id], manager.lora_digests[b.lora_int_id])
    ]
    for blocks in names:
        assert set(blocks) <= cached
    assert len(set().union(*names)) == 15


def test_smollm2_with_an_adapter_matches_transformers_peft_merged(hf_smollm2, tmp_path):
    """Once on the real model: a rank-8 adapter on every module of SmolLM2-135M (loaded from the GGUF, as ours)."""
    from peft import LoraConfig, get_peft_model

    hf = copy.deepcopy(hf_smollm2.model)  # PEFT changes the model it wraps; the session's reference stays as it is
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=ALL_MODULES, init_lora_weights=False)
    peft_model = get_peft_model(hf, config)
    with torch.no_grad():  # small deltas, as a trained adapter's: the model still speaks
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.3)
    peft_model.save_pretrained(tmp_path / "adapter")
    reference = HFReference(peft_model.merge_and_unload().eval())
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", enable_lora=True, max_lora_rank=8)
    adapter = LoRARequest("smol", 1, str(tmp_path / "adapter"))
    prompt = llm.get_tokenizer().encode("The capital of France is")
    ours = greedy(llm, [prompt], adapter)[0]
    assert ours != greedy(llm, [prompt], None)[0]
    assert_greedy_matches(ours, *reference.greedy(prompt, MAX_TOKENS), label="smollm2 + adapter")


# ---- kernels: the Triton shrink/expand and the CPU kernel against the torch reference -----------------------------

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def random_slots(slots, rank, fan_in, slice_sizes, dtype, device):
    """Slots of a layer with len(slice_sizes) slices of rank `rank`: A [slots, slices * rank, in], B [slots, rank,
    out]."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(slots, len(slice_sizes) * rank, fan_in, generator=gen).to(device, dtype)
    b = torch.randn(slots, rank, sum(slice_sizes), generator=gen).to(device, dtype)
    return a, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slot_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_shrink_expand_match_the_reference(device, dtype, slot_dtype):
    # 11 tokens over 3 slots and the base model, 3 slices of rank 16, widths not a tile's multiple; the slots in
    # each --lora-dtype.
    indices = torch.tensor([0, 0, -1, 2, 1, 1, 1, -1, 2, 0, 1], device=device)
    slice_sizes = [40, 36, 24]
    a, b = random_slots(3, 16, 72, slice_sizes, slot_dtype, device)
    x = torch.randn(len(indices), 72, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    y = torch.randn(len(indices), 100, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    h = lora_shrink(x, a, indices)
    torch.testing.assert_close(h, lora_shrink_ref(x, a, indices), rtol=1e-4, atol=1e-3)
    ours, expected = y.clone(), y.clone()
    lora_expand(h, b, indices, ours, slice_sizes)
    lora_expand_ref(h, b, indices, expected, slice_sizes)
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-1}
    torch.testing.assert_close(ours, expected, **tolerance)
    assert torch.equal(ours[indices < 0], y[indices < 0])  # base-model rows untouched


def test_kernel_meta_groups_tokens_by_slot_in_batch_order():
    order, active, start_loc = lora_kernel_meta(torch.tensor([3, 0, -1, 3, 0, 1, -1, 3]))
    assert active.tolist() == [0, 1, 3] and start_loc.tolist() == [0, 2, 3, 6]
    assert order.tolist() == [1, 4, 5, 0, 3, 7]  # each slot's tokens once, base-model tokens in no group


@pytest.mark.parametrize("slot_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kernel_matches_the_reference(dtype, slot_dtype):
    """A packed layer (three slices) with adapters of ranks 2 and 5 in slots of 8, the slots in each --lora-dtype,
    over groups of tokens longer and shorter than the kernel's blocks, interleaved with each other and with
    base-model tokens, all shorter than the matrix-multiply path's (below); x a strided view, widths no vector's
    multiple."""
    slots, max_rank, fan_in, out_sizes = 3, 8, 152, (144, 8, 40)
    gen = torch.Generator().manual_seed(4)
    a = torch.zeros(slots, 3 * max_rank, fan_in)
    b = torch.zeros(slots, max_rank, sum(out_sizes))
    for slot, rank in ((0, 2), (2, 5)):  # as LinearWithLoRA.set_slot lays them out
        for i in range(3):
            a[slot, i * max_rank : i * max_rank + rank] = torch.randn(rank, fan_in, generator=gen)
        b[slot, :rank] = torch.randn(rank, sum(out_sizes), generator=gen)
    a, b = a.to(slot_dtype), b.to(slot_dtype)
    indices = torch.tensor([0, 0, 2, -1, -1] + [2] * 9 + [0, -1, 0] + [2, 0] * 5)
    x = torch.randn(len(indices), fan_in + 5, generator=gen).to(dtype)[:, 5:]
    y = torch.randn(len(indices), sum(out_sizes), generator=gen).to(dtype)
    ours, expected = y.clone(), y.clone()
    lora_cpu_kernel()(x, ours, a, b, *lora_kernel_meta(indices), torch.tensor([2, 0, 5]), list(out_sizes))
    lora_expand_ref(lora_shrink_ref(x, a, indices), b, indices, expected, list(out_sizes))
    exact = dtype == torch.float32 and slot_dtype == torch.float32
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if exact else {"rtol": 2e-2, "atol": 1e-1}
    torch.testing.assert_close(ours, expected, **tolerance)
    assert not torch.equal(ours[indices >= 0], y[indices >= 0])
    assert torch.equal(ours[indices < 0], y[indices < 0])  # base-model rows untouched


def test_cpu_kernel_matrix_multiply_path_matches_the_reference():
    """bfloat16 x and slots with groups of a prompt's size (140 tokens: blocks of 64 and the rest; 18 tokens) take the
    matrix-multiply path, which rounds h to bfloat16 between its two products: the reference rounded the same way
    agrees to y's last bits, and to one bfloat16 step of an h where the CPU's product summed x A in another order
    and h rounded the other way (brgemm without AMX). Odd ranks, a group too short for the path and base-model tokens
    beside them."""
    slots, max_rank, fan_in, out_sizes = 3, 8, 152, (144, 8, 40)
    gen = torch.Generator().manual_seed(5)
    a = torch.zeros(slots, 3 * max_rank, fan_in)
    b = torch.zeros(slots, max_rank, sum(out_sizes))
    for slot, rank in ((0, 3), (1, 8), (2, 5)):
        for i in range(3):
            a[slot, i * max_rank : i * max_rank + rank] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
        b[slot, :rank] = torch.randn(rank, sum(out_sizes), generator=gen)
    a, b = a.bfloat16(), b.bfloat16()
    indices = torch.tensor([2] * 90 + [0, -1, 1] * 10 + [2] * 50 + [1] * 8 + [-1])
    x = torch.randn(len(indices), fan_in + 4, generator=gen).bfloat16()[:, 4:]
    y = torch.randn(len(indices), sum(out_sizes), generator=gen).bfloat16()
    ours, expected = y.clone(), y.clone()
    lora_cpu_kernel()(x, ours, a, b, *lora_kernel_meta(indices), torch.tensor([3, 8, 5]), list(out_sizes))
    h = lora_shrink_ref(x, a, indices).bfloat16().float()
    lora_expand_ref(h, b, indices, expected, list(out_sizes))
    step = 2.0 ** (torch.floor(torch.log2(h.abs().clamp_min(1e-30))) - 7)  # one bfloat16 step of each h
    flips = torch.zeros(y.shape)
    lora_expand_ref(step, b.abs(), indices, flips, list(out_sizes))  # what each h rounded the other way could move
    allowed = 2e-2 + 1e-2 * expected.float().abs() + flips  # y rounded once here, twice there
    worst = ((ours.float() - expected.float()).abs() / allowed).max().item()
    assert worst <= 1.0, f"{worst:.2f} of the rounding allowed"
    assert (ours.float() - y.float()).abs()[indices >= 0].amax(1).min() > 0.1  # every adapted row got its delta
    assert torch.equal(ours[indices < 0], y[indices < 0])


def test_cpu_kernel_refuses_a_slot_out_of_range():
    x, y = torch.randn(2, 8), torch.zeros(2, 4)
    a, b = torch.zeros(2, 4, 8), torch.zeros(2, 4, 4)
    with pytest.raises(RuntimeError, match="active LoRA slot out of range"):
        lora_cpu_kernel()(x, y, a, b, *lora_kernel_meta(torch.tensor([0, 2])), torch.tensor([4, 4]), [4])
