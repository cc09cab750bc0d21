"""DeepSeek-V3's multi-token-prediction (MTP) layers: a checkpoint whose config sets num_nextn_predict_layers and
whose tensors carry the MTP layer as model.layers.{num_hidden_layers} (a whole decoder layer, with its experts, beside
enorm, hnorm, eh_proj, embed_tokens and shared_head) loads, the engine skips that layer, and its greedy output is
still Hugging Face's on the model without it."""

import families
import torch
from test_deepseek import deepseek_v3, save_v3_with_random_bias
from test_qwen_moe import rewrite_checkpoint

from conftest import assert_no_leaks, run_greedy


def add_mtp_layer(tensors: dict, num_layers: int, hidden: int, vocab: int) -> dict:
    """The checkpoint with an MTP layer after the last decoder layer: a copy of that layer's tensors (attention,
    norms, routed and shared experts) under the next index, and the MTP's own, drawn at random."""
    gen = torch.Generator().manual_seed(3)
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    out = dict(tensors)
    for name, t in tensors.items():
        if name.startswith(last):
            out[mtp + name.removeprefix(last)] = t.clone()
    own = {
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden),
        "embed_tokens.weight": (vocab, hidden),
        "shared_head.norm.weight": (hidden,),
        "shared_head.head.weight": (vocab, hidden),
    }
    for name, shape in own.items():
        out[mtp + name] = torch.randn(shape, generator=gen)
    return out


def test_deepseek_v3_checkpoint_with_mtp_weights_loads_and_matches_hf(tmp_path):
    config = deepseek_v3("interleaved-normalised")
    path, hf_model = save_v3_with_random_bias(tmp_path, config)
    n, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    with_mtp = rewrite_checkpoint(
        path,
        change_config=lambda c: {**c, "num_nextn_predict_layers": 1},
        change_tensors=lambda t: add_mtp_layer(t, n, hidden, vocab),
    )
    engine = families.make_engine(with_mtp, max_num_batched_tokens=16)
    model = engine.executor.driver_worker.model
    assert len(model.layers) == n and engine.model_config.hf_config["num_nextn_predict_layers"] == 1
    batch = families.prompts(config, (19, 45))
    families.assert_matches_hf(hf_model, batch, run_greedy(engine, batch, families.MAX_TOKENS), "with MTP weights")
    assert_no_leaks(engine)
