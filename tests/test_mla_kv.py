"""KV connectors, the KV store, P/D and KV events on a multi-head latent attention model (a tiny DeepSeek-V2): a block
is each layer's latent vectors, [layers, block size, kv_lora_rank + qk_rope_head_dim], under a fingerprint that names
MLA's spec. A second engine loads the first one's blocks and its greedy output equals Hugging Face's."""

import json

import families
import numpy as np
import pytest
import torch
from test_deepseek import KV_LORA_RANK, QK_ROPE, deepseek_v2
from test_kv_groups import (  # noqa: F401 (kvstore and config: the fixtures)
    BLOCK,
    MAX_TOKENS,
    assert_matches,
    check_prefill_and_decode,
    config,
    kvstore,
    make_engine,
    settle,
)

from conftest import HFReference, assert_no_leaks, run_greedy
from engine.kv.connector.block_io import KVBlockIO
from engine.kv.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec
from engine.kv.layout import KVLayout, block_shape, model_fingerprint

LAYERS = 3
LATENT = KV_LORA_RANK + QK_ROPE
MLA = MLAAttentionSpec(KV_LORA_RANK, QK_ROPE)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    config = deepseek_v2()
    path, hf_model = families.save_family_model(tmp_path_factory.mktemp("deepseek"), config)
    prompts = families.prompts(config, (37, 26))
    references = [HFReference(hf_model).greedy(p, MAX_TOKENS) for p in prompts]
    return path, prompts, references


def loaded_blocks(prompts) -> int:
    return sum((len(p) - 1) // BLOCK for p in prompts)  # every full prompt block but the last token's


def test_the_latent_layout_and_its_fingerprint():
    assert block_shape(MLA, LAYERS, 4, BLOCK, QK_ROPE) == (LAYERS, BLOCK, LATENT)
    assert block_shape(FullAttentionSpec(), LAYERS, 4, BLOCK, 16) == (LAYERS, 2, 4, BLOCK, 16)
    layout = KVLayout("0" * 64, "bfloat16", (LAYERS, BLOCK, LATENT), kv_cache_spec=MLA)
    assert layout.is_mla and layout.block_size == BLOCK and layout.num_layers == LAYERS
    assert layout.block_bytes == LAYERS * BLOCK * LATENT * 2
    # The same model, dtype, backend and shape: only the spec tells an MLA group's blocks from a full group's.
    args = ("weights", "float32", "torch", (LAYERS, BLOCK, LATENT), "sha256", 0, 1, 0)
    mla = model_fingerprint(*args, MLA, (0, 1, 2))
    assert mla != model_fingerprint(*args, FullAttentionSpec(), (0, 1, 2))
    assert mla != model_fingerprint(*args, MLAAttentionSpec(KV_LORA_RANK + 8, QK_ROPE - 8), (0, 1, 2))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_block_io_moves_each_layers_latent_blocks(device):
    """Blocks read from one latent cache and written into another land in the same places: on CPU through numpy
    views, on a GPU through torch."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(0)
    layout = KVLayout("0" * 64, "float32", (LAYERS, BLOCK, LATENT), kv_cache_spec=MLA)
    source = [torch.randn(10, BLOCK, LATENT, generator=gen).to(device) for _ in range(LAYERS)]
    target = [torch.zeros_like(t) for t in source]
    ids, into = [7, 2, 5], [1, 8, 3]
    data = KVBlockIO(source, layout).read(ids)
    assert len(data) == 3 and all(len(block) == layout.block_bytes for block in data)
    first = np.frombuffer(data[0], dtype=np.float32).reshape(layout.shape)
    np.testing.assert_array_equal(first[1], source[1][7].cpu().numpy())
    KVBlockIO(target, layout).write(into, b"".join(data))
    for s, t in zip(source, target):
        torch.testing.assert_close(t[into], s[ids], rtol=0, atol=0)
        assert not t[[0, 2, 4, 5, 6, 7, 9]].any()  # nothing else written


def test_a_second_engine_loads_the_latent_blocks_and_matches_hf(deepseek, config):
    path, prompts, references = deepseek
    first = make_engine(path, config)
    (layout,) = first.info.kv_layouts
    assert layout.is_mla and layout.shape == (LAYERS, BLOCK, LATENT)
    assert layout.block_bytes == first.executor.get_cache_block_size_bytes()
    assert_matches(run_greedy(first, prompts, MAX_TOKENS), references, "first engine")
    settle(first)
    assert first.get_stats().kv_connector_stats["stored_blocks"] >= loaded_blocks(prompts)

    second = make_engine(path, config, enable_kv_cache_events=True)
    assert second.info.kv_layouts == (layout,)
    assert_matches(run_greedy(second, prompts, MAX_TOKENS), references, "second engine")
    stats = second.get_stats().kv_connector_stats
    assert stats["loaded_tokens"] == loaded_blocks(prompts) * BLOCK
    assert stats["loaded_bytes"] == loaded_blocks(prompts) * layout.block_bytes
    # The loaded blocks joined the prefix cache as loaded from the connector's medium (KV events).
    medium = "kvstore" if "KVStoreConnector" in config else "shared_storage"
    events = second.kv_cache_manager.take_events()
    loaded = [h for e in events if getattr(e, "loaded_from", None) == medium for h in e.block_hashes]
    assert len(loaded) == loaded_blocks(prompts)
    settle(second)
    assert_no_leaks(second)


def test_the_stored_and_loaded_blocks_are_the_first_engines_latents(deepseek, tmp_path):
    """Each shared-storage file holds a block of the first engine's latent cache byte for byte, and the second engine's
    cache holds the same bytes after loading it."""
    path, prompts, _ = deepseek
    extra = {"shared_storage_path": str(tmp_path)}
    config = json.dumps({"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": extra})
    engines = [make_engine(path, config), make_engine(path, config)]
    for engine in engines:
        run_greedy(engine, prompts[:1], 1)
    (layout,) = engines[0].info.kv_layouts
    files = sorted((tmp_path / layout.fingerprint).iterdir())
    assert len(files) == (len(prompts[0]) - 1) // BLOCK
    assert engines[1].get_stats().kv_connector_stats["loaded_tokens"] == len(files) * BLOCK
    for engine in engines:
        block_io = KVBlockIO(engine.executor.driver_worker.kv_caches, layout)
        for file in files:
            block = engine.kv_cache_manager.block_pool.get_cached_block(bytes.fromhex(file.name))
            assert file.read_bytes()[:-4] == block_io.read([block.block_id])[0]


def test_prefill_and_decode_engines_hand_over_the_latents(deepseek, kvstore):
    check_prefill_and_decode(*deepseek, kvstore)


def test_tensor_parallel_ranks_share_one_copy_of_each_latent_block(deepseek, tmp_path):
    """Every rank holds the whole latent cache: both ranks' blocks go under one fingerprint, and a second two-rank
    engine loads them and matches Hugging Face."""
    path, prompts, references = deepseek
    extra = {"shared_storage_path": str(tmp_path)}
    config = json.dumps({"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": extra})
    for label in ("first", "second"):
        engine = make_engine(path, config, tensor_parallel_size=2)
        try:
            (layout,) = engine.info.kv_layouts
            assert layout.shard_fingerprints == () and [p.name for p in tmp_path.iterdir()] == [layout.fingerprint]
            assert_matches(run_greedy(engine, prompts, MAX_TOKENS), references, f"{label} engine")
            if label == "second":
                stats = engine.get_stats().kv_connector_stats
                assert stats["loaded_tokens"] == loaded_blocks(prompts) * BLOCK
        finally:
            engine.shutdown()
    assert len(list((tmp_path / layout.fingerprint).iterdir())) == loaded_blocks(prompts)
