"""One declaration per setting: its name, default, allowed values and help live on its dataclass field, and the
command-line flags, their --help, the offline keywords and docs/flags.md are all read from there."""

import argparse
import dataclasses
import re
import typing

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def setting(
    default=dataclasses.MISSING,
    *,
    help: str,
    choices: tuple | None = None,
    default_factory=dataclasses.MISSING,
    flag: str | None = None,
    repeatable: bool = False,
    positional: bool = False,
    const=None,
):
    """A dataclass field that is also a flag: `--name-with-dashes` (or `flag`), a list field given as several
    values (`--flag a b`) or, when repeatable, as a repeated flag (`--flag a --flag b`); with a const, the flag
    alone means that value."""
    metadata = {
        "help": help,
        "choices": choices,
        "flag": flag,
        "repeatable": repeatable,
        "positional": positional,
        "const": const,
    }
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def check_choices(config) -> None:
    """The declared choices of each field, for a config built from keywords rather than flags."""
    for f in dataclasses.fields(config):
        value, choices = getattr(config, f.name), f.metadata.get("choices")
        if choices is not None and value is not None and value not in choices:
            unset = " (or unset)" if f.default is None else ""
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}{unset}, got {value!r}.")


def parse_memory_size(value: str | int) -> int:
    """'4GiB', '512MiB', '1.5GB' or a plain byte count -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(
            f"kv_cache_memory must be a size in bytes, optionally with a GiB/MiB/KiB/GB/MB/KB suffix, got {value!r}."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def parse_int_list(value: str) -> list[int]:
    """'1,2,4', '1 2 4' or '[1, 2, 4]' -> [1, 2, 4] (the last is how a list prints, so flags round-trip)."""
    return [int(v) for v in value.strip("[]").replace(",", " ").split()]


def _optional(t):
    """T for `T | None`."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args and type(None) in typing.get_args(t) else t


def _is_str_list(t) -> bool:
    return typing.get_origin(_optional(t)) is list and typing.get_args(_optional(t)) == (str,)


def _scalar_type(t) -> type:
    """int for `int` and `int | None`, and so on; a list of ints is parsed from one string, a list of strings is
    given as several values."""
    t = _optional(t)
    if typing.get_origin(t) is list:
        return str if typing.get_args(t) == (str,) else parse_int_list
    if typing.get_origin(t) is not None:  # e.g. `str | dict` (a dict offline, JSON on the command line)
        return str
    return t


def description(config: type) -> str:
    """A config's docstring as one paragraph: its flags' group description in --help and docs/flags.md."""
    return " ".join((config.__doc__ or "").split())


def add_argument(parser, f: dataclasses.Field, annotation=None) -> argparse.Action:
    """The flag of one field, as its declaration says (the annotation, if given, is the type the flag parses to)."""
    meta, t = f.metadata, annotation or f.type
    if meta["positional"]:
        return parser.add_argument(f.name, help=meta["help"])
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    kwargs = {"help": meta["help"], "dest": f.name, "default": default}
    names = [meta["flag"] or "--" + f.name.replace("_", "-")]
    if t is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif meta["repeatable"]:
        kwargs["action"] = "append"
    elif meta["const"] is not None:
        kwargs.update(nargs="?", const=meta["const"])
    elif _is_str_list(t):
        kwargs["nargs"] = "+"  # as vLLM gives a list: --lora-modules a=/x b=/y
    else:
        kwargs["type"] = _scalar_type(t)
    if meta["choices"] is not None:
        kwargs["choices"] = meta["choices"]
    return parser.add_argument(*names, **kwargs)


def add_cli_args(parser: argparse.ArgumentParser, config: type, grouped: bool = True) -> None:
    """A config's fields as flags; grouped, in a group named for the config and described by its docstring (a
    group that several commands take is one thing, described once in docs/flags.md)."""
    target = parser.add_argument_group(config.__name__, description(config)) if grouped else parser
    for f in dataclasses.fields(config):
        add_argument(target, f)


def config_from(config: type, source):
    """The config with the values of its fields in source: the flags' Namespace, or a flat front (EngineArgs)."""
    return config(**{f.name: getattr(source, f.name) for f in dataclasses.fields(config)})
