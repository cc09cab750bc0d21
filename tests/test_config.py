"""EngineArgs and the `llmmesh` flags: names, environment defaults (LLMMESH_<FLAG>), memory sizes and validation."""

import argparse
import dataclasses

import pytest

from engine.config import EngineArgs, LoRAConfig, SchedulerConfig, parse_int_list, parse_memory_size
from services import client, config
from services.cli import build_parser


def parse(argv):
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def test_memory_sizes():
    assert parse_memory_size("4GiB") == 4 * 2**30
    assert parse_memory_size("512MiB") == 512 * 2**20
    assert parse_memory_size("1.5GB") == 1_500_000_000
    assert parse_memory_size("1000") == 1000
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory_size("lots")


def test_the_step_budget_follows_the_device():
    """Unset, a step holds 512 tokens on a CPU and 2048 on a GPU; the image encoder's budget stays 2048 unless set."""
    for device, budget in (("cpu", 512), ("cuda", 2048)):
        sched = EngineArgs().create_engine_config().scheduler_config
        sched.resolve(device)
        assert (sched.max_num_batched_tokens, sched.max_num_encoder_input_tokens, sched.encoder_cache_size) == (
            budget,
            2048,
            2048,
        )
    given = EngineArgs(max_num_batched_tokens=4096).create_engine_config().scheduler_config
    given.resolve("cpu")
    assert (given.max_num_batched_tokens, given.max_num_encoder_input_tokens, given.encoder_cache_size) == (4096,) * 3
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least 1, got 0"):
        EngineArgs(max_num_batched_tokens=0)


def test_flags_use_vllm_names_and_defaults():
    args = parse([])
    assert (args.block_size, args.max_num_batched_tokens, args.max_num_seqs) == (16, None, 256)
    assert args.enable_prefix_caching is True and args.scheduling_policy == "fcfs"
    args = parse(
        [
            "--no-enable-prefix-caching",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "1GiB",
            "--scheduling-policy",
            "priority",
            "--long-prefill-token-threshold",
            "64",
        ]
    )
    assert args.enable_prefix_caching is False and args.block_size == 32 and args.kv_cache_memory == "1GiB"
    assert args.scheduling_policy == "priority" and args.long_prefill_token_threshold == 64


def llmmesh(argv):
    """`llmmesh ARGV` parsed by the real command's parser, built now (so it reads the environment now)."""
    return build_parser().parse_args(argv)


def test_environment_sets_defaults(monkeypatch):
    monkeypatch.setenv("LLMMESH_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("LLMMESH_ENABLE_PREFIX_CACHING", "false")
    args = EngineArgs.from_cli_args(llmmesh(["engine"]))
    assert args.max_num_seqs == 7 and args.enable_prefix_caching is False
    assert llmmesh(["engine", "--max-num-seqs", "9"]).max_num_seqs == 9  # a flag beats the environment
    assert llmmesh(["engine", "--enable-prefix-caching"]).enable_prefix_caching is True
    # The same variable is the same flag in every command that has it.
    assert llmmesh(["serve"]).max_num_seqs == llmmesh(["run-offline"]).max_num_seqs == 7


def test_the_engine_seed_and_the_sampling_seed_are_two_variables(monkeypatch):
    """LLMMESH_SEED is the engine's --seed only; the clients' and run-offline's per-request seed is
    LLMMESH_SAMPLING_SEED."""
    monkeypatch.setenv("LLMMESH_SEED", "5")
    monkeypatch.setenv("LLMMESH_SAMPLING_SEED", "9")
    for command in ("engine", "serve", "demo", "run-offline"):
        assert llmmesh([command]).seed == 5, command
    assert llmmesh(["run-offline"]).sampling_seed == 9
    for command in ("generate", "chat"):
        args = llmmesh([command, "a prompt"])
        assert not hasattr(args, "seed"), command
        assert client.sampling_params(**client._sampling_args(args)).seed == 9, command
    monkeypatch.delenv("LLMMESH_SAMPLING_SEED")
    assert not client.sampling_params(**client._sampling_args(llmmesh(["generate", "a prompt"]))).HasField("seed")


def test_limits_and_gateway_dependencies_from_the_environment(monkeypatch):
    monkeypatch.setenv("LLMMESH_MAX_N", "3")
    monkeypatch.setenv("LLMMESH_ENGINE", "a:1,b:2")
    monkeypatch.setenv("LLMMESH_TOKENIZER", "tok:3")
    monkeypatch.setenv("LLMMESH_DETOKENIZER", "detok:4")
    monkeypatch.setenv("LLMMESH_SERVED_MODEL_NAME", "my-model")
    gateway = llmmesh(["gateway"])
    assert gateway.max_n == 3 and config.limits_from_args(gateway).max_n == 3
    assert gateway.engine == ["a:1", "b:2"]  # a comma-separated list: two engines
    assert (gateway.tokenizer, gateway.detokenizer, gateway.served_model_name) == ("tok:3", "detok:4", "my-model")
    for service in ("engine", "tokenizer", "detokenizer", "serve"):
        assert llmmesh([service]).max_n == 3, service
    assert llmmesh(["gateway", "--max-n", "5"]).max_n == 5


def test_switches_read_true_and_false(monkeypatch):
    for value, expected in [("false", False), ("0", False), ("", False), ("true", True), ("1", True), ("yes", True)]:
        monkeypatch.setenv("LLMMESH_TRUST_REQUEST_CHAT_TEMPLATE", value)
        for service in ("tokenizer", "gateway", "serve"):
            assert llmmesh([service]).trust_request_chat_template is expected, (service, value)
    monkeypatch.setenv("LLMMESH_TRUST_REQUEST_CHAT_TEMPLATE", "perhaps")
    with pytest.raises(SystemExit, match="LLMMESH_TRUST_REQUEST_CHAT_TEMPLATE"):
        build_parser()
    monkeypatch.setenv("LLMMESH_TRUST_REQUEST_CHAT_TEMPLATE", "false")
    monkeypatch.setenv("LLMMESH_MAX_N", "three")
    with pytest.raises(SystemExit, match="LLMMESH_MAX_N"):
        build_parser()


def env_value(action: argparse.Action) -> tuple[str, object]:
    """A value for the flag's variable that differs from its default, and what the flag then holds."""
    if action.nargs == 0:
        return ("false", False) if action.default else ("true", True)
    if action.choices:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    if isinstance(action, argparse._AppendAction):
        return "x:1,y:2", ["x:1", "y:2"]
    if action.nargs in ("+", "*"):  # given as --flag a b
        return "a=1, b=2", ["a=1", "b=2"]
    if action.type is int:
        value = 7 if action.default != 7 else 8
        return str(value), value
    if action.type is float:
        return "0.25", 0.25
    if action.type is parse_int_list:
        return "1,2,4", [1, 2, 4]
    return "from-env", "from-env"


def subcommands(parser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_flag_reads_its_variable(monkeypatch):
    """Every flag of every `llmmesh` command is also LLMMESH_<DEST>, and says so in its help."""
    checked = 0
    for name, sub in subcommands(build_parser()).items():
        positionals = ["x" for a in sub._actions if not a.option_strings]
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            variable = config.env_name(action.dest)
            assert variable in action.help, (name, action.dest)
            value, expected = env_value(action)
            with monkeypatch.context() as m:
                m.setenv(variable, value)
                parsed = build_parser().parse_args([name, *positionals])
            assert getattr(parsed, action.dest) == expected, (name, variable, value)
            checked += 1
    assert checked > 100


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


def test_engine_args_builds_the_composed_configs():
    """EngineArgs is the flat front: its fields are the configs' own, and create_engine_config() builds them."""
    config = EngineArgs(max_num_seqs=7, block_size=32, enable_lora=True, lora_modules=["a=/x"]).create_engine_config()
    assert config.scheduler_config.max_num_seqs == 7 and config.cache_config.block_size == 32
    assert config.lora_config.lora_modules == ["a=/x"] and config.model_config.model == EngineArgs().model
    assert EngineArgs(**dataclasses.asdict(EngineArgs(max_num_seqs=7))) == EngineArgs(max_num_seqs=7)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        LoRAConfig(lora_dtype="float32")
