"""On a CUDA device: bfloat16 greedy output against Hugging Face in bfloat16, near-tie rule; CUDA graphs
against eager; the KV cache sized from --gpu-memory-utilization.

Skipped without CUDA. The device machines cannot carry the SmolLM2 file, so this uses a
random model of the same architecture (30 layers, GQA 9/3, head_dim 64).
"""

import gc

import pytest
import torch

from conftest import HFReference, assert_no_leaks, run_greedy
from engine.config import EngineArgs
from engine.core import EngineCore
from random_model import save_random_smollm2_shaped

pytestmark = pytest.mark.gpu

# bfloat16 keeps 8 bits of mantissa: logits of order 10 carry errors of order 0.05.
BF16_NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory):
    path = tmp_path_factory.mktemp("smollm2-shaped")
    model = save_random_smollm2_shaped(path)
    return path, HFReference(model.to("cuda", torch.bfloat16).eval())


def test_bf16_greedy_matches_hf_on_gpu(smollm2_shaped):
    path, reference = smollm2_shaped
    engine = EngineCore(EngineArgs(model=str(path), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.5))
    assert engine.num_blocks > 0
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(17, 49152, (n,), generator=gen).tolist() for n in (7, 33, 120, 300, 511, 64, 16, 200)]
    outputs = run_greedy(engine, prompts, 32)
    for i, (p, ours) in enumerate(zip(prompts, outputs)):
        ref_tokens, ref_logits = reference.greedy(p, 32)
        for j, (a, b) in enumerate(zip(ours, ref_tokens)):
            if a != b:
                top2 = ref_logits[j].topk(2).values
                assert (top2[0] - top2[1]).item() <= BF16_NEAR_TIE, f"prompt {i} token {j}"
                break
    assert_no_leaks(engine)


def engine_on_gpu(path, **args) -> EngineCore:
    gc.collect()  # earlier tests' engines may sit in reference cycles, holding device memory the start-up check needs
    return EngineCore(
        EngineArgs(model=str(path), dtype="bfloat16", device="cuda", **{"gpu_memory_utilization": 0.3, **args})
    )


def test_cuda_graphs_give_the_same_greedy_tokens_as_eager(smollm2_shaped):
    path, _ = smollm2_shaped
    gen = torch.Generator().manual_seed(1)
    # 11 requests ending at different steps: decode batches of 11 down to 1, most of them padded.
    prompts = [
        torch.randint(17, 49152, (n,), generator=gen).tolist() for n in (5, 40, 300, 17, 90, 8, 250, 64, 3, 128, 33)
    ]
    max_tokens = [4 + 3 * i for i in range(len(prompts))]
    eager = engine_on_gpu(path, enforce_eager=True)
    graphs = engine_on_gpu(path)
    assert eager.worker.model_runner.cudagraphs is None
    expected = run_greedy(eager, prompts, max_tokens)
    assert run_greedy(graphs, prompts, max_tokens) == expected
    replays = graphs.worker.model_runner.cudagraphs.replays
    assert {1, 2, 4, 8, 16} <= set(replays), replays  # padded batches too (3, 5..7, 9..11)
    assert_no_leaks(eager)
    assert_no_leaks(graphs)


def test_kv_cache_fills_the_configured_share_of_the_device(smollm2_shaped):
    path, _ = smollm2_shaped
    gc.collect()
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    share = 0.4 * total
    engine = engine_on_gpu(path, gpu_memory_utilization=0.4)
    used = free_before - torch.cuda.mem_get_info()[0]
    # Everything the engine keeps (weights, KV cache, graphs, workspaces) is its share, less the peak activations
    # it left room for (small here: at most 2048 tokens).
    assert share - 0.02 * total <= used <= share + 0.005 * total, (used / 2**30, share / 2**30)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(17, 49152, (n,), generator=gen).tolist() for n in (2000, 700, 30, 1500)]
    run_greedy(engine, prompts, 16)
    used = free_before - torch.cuda.mem_get_info()[0]
    assert used <= share + 0.005 * total, (used / 2**30, share / 2**30)
    assert_no_leaks(engine)


def test_no_memory_left_for_the_kv_cache_fails_clearly(smollm2_shaped):
    path, _ = smollm2_shaped
    with pytest.raises(ValueError, match="No device memory left for the KV cache"):
        engine_on_gpu(path, gpu_memory_utilization=0.001)  # under the weights alone (270 MB)
    with pytest.raises(ValueError, match="Free device memory"):
        engine_on_gpu(path, gpu_memory_utilization=1.0)  # the CUDA context alone takes some
