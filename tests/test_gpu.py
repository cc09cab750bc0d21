"""On a CUDA device: bfloat16 greedy output against Hugging Face in bfloat16, near-tie rule.

Skipped without CUDA. The device machines cannot carry the SmolLM2 file, so this uses a
random model of the same architecture (30 layers, GQA 9/3, head_dim 64).
"""

import pytest
import torch

from conftest import HFReference, assert_no_leaks, run_greedy
from engine.config import EngineArgs
from engine.core import EngineCore

pytestmark = pytest.mark.gpu

# bfloat16 keeps 8 bits of mantissa: logits of order 10 carry errors of order 0.05.
BF16_NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.05,
        bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("smollm2-shaped")
    model.save_pretrained(path)
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
