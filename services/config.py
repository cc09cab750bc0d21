"""One way to configure a service: command-line flags, each also settable as LLMMESH_<FLAG_NAME>.

Every parser of the `llmmesh` command goes through `apply_env` once it is built, so a flag `--max-n`
reads LLMMESH_MAX_N whatever service defines it, and a variable means the same flag everywhere.
Every flag is declared once, on a field of a settings dataclass (services/settings.py, engine/config/), and
its parser is built from those.
"""

import argparse
import asyncio
import logging
import os
import re

from engine.config import DEFAULT_MODEL  # noqa: F401 (the one name of the default model, for every service)
from engine.config.utils import add_cli_args, config_from
from engine.limits import RequestLimits
from services import telemetry
from services.settings import DEFAULT_PORTS, EngineObservabilityConfig, ServerConfig, UnixSocketConfig

ENV_PREFIX = "LLMMESH_"


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def _from_env(action: argparse.Action, value: str):
    if action.nargs == 0:  # a switch (--flag, --no-flag, store_true): the variable says true or false
        if value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if value.strip().lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError("expected true or false")
    convert = action.type or str
    if isinstance(action, argparse._AppendAction):  # a list: comma-separated
        return [convert(v) for v in value.split(",") if v]
    if action.nargs in ("+", "*"):  # a list given as --flag a b: commas or spaces between its values
        return [convert(v) for v in re.split(r"[,\s]+", value) if v]
    return convert(value)


def apply_env(parser: argparse.ArgumentParser) -> None:
    """Defaults from LLMMESH_<DEST> for every flag of the parser and its subcommands' parsers."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                apply_env(sub)
        elif action.option_strings and action.dest not in ("help",):
            value = os.environ.get(env_name(action.dest))
            if value is not None:
                try:
                    action.default = _from_env(action, value)
                    if action.choices is not None and action.default not in action.choices:
                        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
                except ValueError as e:
                    raise SystemExit(f"error: {env_name(action.dest)}={value!r}: {e}") from None
            # Escaped: argparse formats help with %; the default and the variable are shown as they are.
            action.help = f"{action.help or ''} {help_suffix(action).replace('%', '%%')}".strip()


def default_text(action: argparse.Action) -> str:
    """A flag's default as --help and docs/flags.md show it (after LLMMESH_* variables are applied)."""
    value = action.default
    if action.nargs == 0:  # a switch
        return "on" if value else "off"
    if value is None:
        return "unset"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value) if value != "" else '""'


def help_suffix(action: argparse.Action) -> str:
    """What apply_env appends to a flag's help: its default and its variable."""
    return f"(default: {default_text(action)}) [env {env_name(action.dest)}]"


def service_parser(
    subparsers, name: str, help: str, port_of: str | None = None, unix_socket: bool = True
) -> argparse.ArgumentParser:
    """A service's subcommand with the flags every service has; --port defaults to that of `port_of`; unix_socket:
    --unix-socket too (the services behind the gateway)."""
    parser = subparsers.add_parser(name, help=help)
    add_cli_args(parser, ServerConfig)
    if unix_socket:
        add_cli_args(parser, UnixSocketConfig)
    parser.set_defaults(port=DEFAULT_PORTS[port_of or name])
    telemetry.add_args(parser)  # --otlp-traces-endpoint, --trace-sample-ratio, --metrics-port
    return parser


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """RequestLimits as flags (--max-n, --max-stop, ...)."""
    add_cli_args(parser, RequestLimits)


def add_detailed_traces_arg(parser: argparse.ArgumentParser) -> None:
    """The engine's --collect-detailed-traces (`llmmesh serve` passes it on to its engine)."""
    add_cli_args(parser, EngineObservabilityConfig)


def limits_from_args(args) -> RequestLimits:
    return config_from(RequestLimits, args)


def setup_logging(level: str = "INFO") -> None:
    """Every process's log format (importing the library configures no logging)."""
    # %(trace)s: the trace id of the traced request being served, so a line leads to its trace.
    logging.basicConfig(
        level=level, format="%(levelname)s %(asctime)s %(name)s:%(trace)s %(message)s", datefmt="%H:%M:%S"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(telemetry.TraceIdFilter())


def run(main, args=None) -> None:
    """Run a service's asyncio main with logging set up."""
    setup_logging(getattr(args, "log_level", "INFO"))
    asyncio.run(main)
