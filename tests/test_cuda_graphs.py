"""CUDA graphs' host side, on CPU: capture sizes, when graphs are used, the persistent input buffers and
the padding of a decode batch to a captured size. The graphs themselves run in tests/test_gpu.py."""

import argparse

import pytest
import torch

from engine.attention.backend import AttentionBackend, layer_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineArgs, parse_int_list
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM
from engine.request import Request, SamplingParams
from engine.worker.cuda_graphs import CUDAGraphs, InputBuffers, use_cudagraphs
from services.local_mesh import engine_flags

BLOCK = 4
CPU = torch.device("cpu")


def cli(*argv) -> EngineArgs:
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def test_default_capture_sizes_are_1_2_4_then_multiples_of_8_up_to_max_num_seqs():
    assert EngineArgs().get_cudagraph_capture_sizes() == [1, 2, 4, *range(8, 257, 8)]
    assert EngineArgs(max_num_seqs=20).get_cudagraph_capture_sizes() == [1, 2, 4, 8, 16]
    assert EngineArgs(max_num_seqs=1024).get_cudagraph_capture_sizes()[-1] == 512
    # A decode batch never has more requests than the token budget either.
    assert EngineArgs(max_num_batched_tokens=12).get_cudagraph_capture_sizes() == [1, 2, 4, 8]


def test_explicit_capture_sizes_are_sorted_deduplicated_and_capped():
    args = EngineArgs(max_num_seqs=64, cudagraph_capture_sizes=[16, 3, 3, 100, 1])
    assert args.get_cudagraph_capture_sizes() == [1, 3, 16]
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        EngineArgs(cudagraph_capture_sizes=[0, 8])


def test_graph_flags_parse_and_round_trip_through_engine_flags():
    args = cli("--cudagraph-capture-sizes", "1,2,4,8", "--enforce-eager")
    assert args.cudagraph_capture_sizes == [1, 2, 4, 8] and args.enforce_eager
    assert cli().cudagraph_capture_sizes is None and not cli().enforce_eager
    # `llmmesh serve` hands its engine flags to the engine process as text.
    assert cli(*engine_flags(args)) == args
    assert parse_int_list("[1, 2, 4]") == parse_int_list("1 2 4") == [1, 2, 4]


class Capable(AttentionBackend):
    cudagraph_support = True


@pytest.mark.parametrize(
    "device, backend, args, expected",
    [
        ("cuda", Capable(), EngineArgs(), True),
        ("cuda", Capable(), EngineArgs(enforce_eager=True), False),
        ("cpu", Capable(), EngineArgs(), False),
        ("cuda", TorchAttentionBackend(BLOCK), EngineArgs(), False),  # its prepare() reads host lists
        ("cuda", Capable(), EngineArgs(cudagraph_capture_sizes=[]), False),
    ],
)
def test_graphs_only_on_cuda_with_a_capable_backend_and_not_enforce_eager(device, backend, args, expected):
    assert use_cudagraphs(args, torch.device(device), backend) is expected


def request(i, prompt_len, num_computed, output=()):
    r = Request(f"r{i}", [100 * i + t for t in range(prompt_len)], SamplingParams(max_tokens=8))
    for t in output:
        r.append_output_token_ids(t)
    r.num_computed_tokens = num_computed
    return r


def blocks_for(r, first):
    return list(range(first, first + -(r.num_tokens // -BLOCK)))


def test_prepare_builds_the_flat_batch():
    # Two decodes (one token each), then a prefill chunk of 3 after 5 cached tokens.
    reqs = [request(0, 6, 6, output=[7]), request(1, 3, 4, output=[8, 9]), request(2, 10, 5)]
    block_ids = [[[3, 9]], [[4, 2]], [[5, 6, 7]]]  # one KV cache group
    buffers = InputBuffers(64, 8, 16, BLOCK, CPU)
    input_ids, positions, (md,), logits_indices = buffers.prepare(reqs, [1, 1, 3], block_ids, [0, 1])
    assert input_ids.tolist() == [7, 9, 205, 206, 207]
    assert positions.tolist() == [6, 4, 5, 6, 7]
    # slot = block_table[row][pos // 4] * 4 + pos % 4
    assert md.slot_mapping.tolist() == [9 * 4 + 2, 2 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3]
    assert md.query_start_loc.tolist() == md.query_start_loc_cpu == [0, 1, 2, 5]
    assert md.seq_lens.tolist() == md.seq_lens_cpu == [7, 5, 8]
    assert md.block_table[:, :3].tolist() == [[3, 9, 0], [4, 2, 0], [5, 6, 7]]
    assert (md.num_actual_tokens, md.num_decodes) == (5, 2)
    assert logits_indices.tolist() == [0, 1]


def test_each_kv_cache_group_has_its_block_table_and_slots():
    """Two groups (a sliding group's table starts with the null block 0 where blocks fell out of its window): the
    same tokens, each group's own slots and table, the rest shared."""
    reqs = [request(0, 6, 6, output=[7]), request(2, 10, 5)]
    block_ids = [[[3, 9], [0, 8]], [[5, 6, 7], [0, 1, 4]]]
    buffers = InputBuffers(64, 8, 16, BLOCK, CPU, num_kv_cache_groups=2)
    _, positions, (full, sliding), _ = buffers.prepare(reqs, [1, 3], block_ids, [0])
    assert positions.tolist() == [6, 5, 6, 7]
    assert full.slot_mapping.tolist() == [9 * 4 + 2, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3]
    assert sliding.slot_mapping.tolist() == [8 * 4 + 2, 1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3]
    assert full.block_table[:, :3].tolist() == [[3, 9, 0], [5, 6, 7]]
    assert sliding.block_table[:, :3].tolist() == [[0, 8, 0], [0, 1, 4]]
    assert full.seq_lens_cpu == sliding.seq_lens_cpu == [7, 8] and full.num_decodes == sliding.num_decodes == 1


def test_padding_rows_write_nothing_and_attend_to_nothing():
    reqs = [request(0, 6, 6, output=[7]), request(1, 3, 4, output=[8, 9]), request(2, 5, 5, output=[1])]
    block_ids = [[[3, 9]], [[4, 2]], [[5, 6]]]
    buffers = InputBuffers(64, 8, 16, BLOCK, CPU)
    # A larger batch first, so the padding must overwrite what it left behind.
    buffers.prepare(
        [request(i, 9, 8, output=[i]) for i in range(8)],
        [1] * 8,
        [[[i, 8 + i, 16 + i]] for i in range(8)],
        list(range(8)),
    )
    input_ids, positions, (md,), logits_indices = buffers.prepare(reqs, [1, 1, 1], block_ids, [0, 1, 2], pad_to=8)
    fresh = InputBuffers(64, 8, 16, BLOCK, CPU).prepare(reqs, [1, 1, 1], block_ids, [0, 1, 2])
    assert input_ids.tolist() == fresh[0].tolist() + [0] * 5
    assert positions.tolist() == fresh[1].tolist() + [0] * 5
    assert md.slot_mapping.tolist() == fresh[2][0].slot_mapping.tolist() + [-1] * 5
    assert md.query_start_loc.tolist() == list(range(9))
    assert md.seq_lens.tolist() == fresh[2][0].seq_lens.tolist() + [0] * 5
    assert (md.num_actual_tokens, md.num_decodes, md.block_table.shape[0]) == (8, 8, 8)
    assert logits_indices.tolist() == fresh[3].tolist() == [0, 1, 2]


def tiny_model(backend):
    config = ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=None,
        eos_token_ids=[],
        torch_dtype=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, backend).eval()
    for weight in model.parameters():  # layers allocate their weights empty, for a loader to fill
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.05)
    return model


def test_padded_size_is_the_next_captured_size_for_decode_only_batches():
    graphs = CUDAGraphs(tiny_model(TorchAttentionBackend(BLOCK)), [], None, [1, 2, 4, 8], [0, 0])
    assert [graphs.padded_size([1] * n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert graphs.padded_size([1, 1, 4]) is None  # a prefill in the batch: eager


@torch.inference_mode()
def test_padded_decode_step_computes_what_the_unpadded_one_does():
    """The graph path's inputs, run eagerly through the Triton kernels (interpreted on CPU): the real rows'
    hidden states and the KV cache come out as without padding."""
    from engine.attention.triton_backend import TritonAttentionBackend

    model = tiny_model(TritonAttentionBackend(BLOCK))
    shape = TritonAttentionBackend.get_kv_cache_shape(32, BLOCK, 2, 16)
    gen = torch.Generator().manual_seed(1)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(2)]
    reqs = [request(0, 6, 6, output=[7]), request(1, 13, 13, output=[8]), request(2, 2, 2, output=[9])]
    block_ids = [[[3, 9]], [[4, 2, 10, 11]], [[5]]]
    results = []
    for pad_to in (None, 8):
        step_caches = [(k.clone(), v.clone()) for k, v in caches]
        buffers = InputBuffers(64, 8, 16, BLOCK, CPU)
        input_ids, positions, md, logits_indices = buffers.prepare(reqs, [1, 1, 1], block_ids, [0, 1, 2], pad_to)
        hidden = model(input_ids, positions, layer_metadata(model.attn_backend, md, [0, 0]), step_caches)
        assert hidden.shape[0] == (pad_to or 3) and torch.isfinite(hidden).all()
        results.append((hidden[logits_indices], step_caches))
    (eager, eager_caches), (padded, padded_caches) = results
    torch.testing.assert_close(padded, eager)
    for (k0, v0), (k1, v1) in zip(eager_caches, padded_caches):
        torch.testing.assert_close(k1, k0)
        torch.testing.assert_close(v1, v0)
    # And the step did write this step's K/V (slot 9*4+2 of request 0): the comparison is not of untouched caches.
    assert not torch.equal(eager_caches[0][0][:, 9, 2], caches[0][0][:, 9, 2])


@torch.inference_mode()
def test_graphs_are_captured_on_a_batch_of_only_padding_which_writes_no_kv():
    """What CUDAGraphs.capture runs (eagerly once, then under capture): it must leave the KV cache untouched."""
    from engine.attention.triton_backend import TritonAttentionBackend

    model = tiny_model(TritonAttentionBackend(BLOCK))
    shape = TritonAttentionBackend.get_kv_cache_shape(8, BLOCK, 2, 16)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    input_ids, positions, mds, logits_indices = InputBuffers(64, 8, 16, BLOCK, CPU).prepare([], [], [], [], pad_to=4)
    (md,) = mds
    assert input_ids.tolist() == positions.tolist() == [0] * 4 and md.slot_mapping.tolist() == [-1] * 4
    assert md.seq_lens.tolist() == [0] * 4 and md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert logits_indices.numel() == 0
    assert torch.isfinite(model(input_ids, positions, layer_metadata(model.attn_backend, mds, [0, 0]), caches)).all()
    for (k, v), (k0, v0) in zip(caches, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)
