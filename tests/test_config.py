"""EngineArgs: flags, environment defaults, memory sizes and validation."""

import argparse

import pytest

from engine.config import EngineArgs, parse_memory_size


def parse(argv):
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def test_memory_sizes():
    assert parse_memory_size("4GiB") == 4 * 2**30
    assert parse_memory_size("512MiB") == 512 * 2**20
    assert parse_memory_size("1.5GB") == 1_500_000_000
    assert parse_memory_size("1000") == 1000
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory_size("lots")


def test_flags_use_vllm_names_and_defaults():
    args = parse([])
    assert (args.block_size, args.max_num_batched_tokens, args.max_num_seqs) == (16, 2048, 256)
    assert args.enable_prefix_caching is True and args.scheduling_policy == "fcfs"
    args = parse(["--no-enable-prefix-caching", "--block-size", "32", "--kv-cache-memory", "1GiB",
                  "--scheduling-policy", "priority", "--long-prefill-token-threshold", "64"])
    assert args.enable_prefix_caching is False and args.block_size == 32 and args.kv_cache_memory == "1GiB"
    assert args.scheduling_policy == "priority" and args.long_prefill_token_threshold == 64


def test_environment_sets_defaults(monkeypatch):
    monkeypatch.setenv("LLMMESH_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("LLMMESH_ENABLE_PREFIX_CACHING", "false")
    args = parse([])
    assert args.max_num_seqs == 7 and args.enable_prefix_caching is False
    assert parse(["--max-num-seqs", "9"]).max_num_seqs == 9  # a flag beats the environment


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 12}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"watermark": 1.0}, "watermark"),
        ({"kv_cache_memory": "big"}, "kv_cache_memory"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs)
