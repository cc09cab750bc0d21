"""docs/flags.md, written from the `llmmesh` command's own parsers: every command, every flag, its default and its
LLMMESH_* variable; a group of flags that several commands take is described once. tests/test_docs.py fails when the file in the repository differs from what this writes.

    .venv/bin/python -m services.flags_doc          # rewrite docs/flags.md (also `make docs`)
"""

import argparse
import os
import sys
from pathlib import Path

from services import config

PATH = Path(__file__).resolve().parent.parent / "docs" / "flags.md"
COMMAND = "python -m services.flags_doc"

INTRO = f"""# Command-line flags

<!-- Written by `{COMMAND}` (or `make docs`) from the parsers in services/ and engine/config/: do not edit by
hand; tests/test_docs.py fails when this file is out of date. -->

Every flag of every `llmmesh` command, as `llmmesh <command> --help` shows it. Each is declared once, on a field of
a config (engine/config/ for the engine's, in vLLM's shape; engine/limits.py for the request limits;
services/settings.py for the services'), and the flags of one config make a group: a command lists the groups it
takes, described once under [Flag groups](#flag-groups), and its own flags. Every flag can also be set in the
environment as `LLMMESH_<NAME>` (the variable column): a switch takes `true`/`false` (`1`/`0`, `yes`/`no`,
`on`/`off`), a repeatable flag a comma-separated list, and a flag given on the command line wins over its variable.
A variable means the same flag in every command that has it, so one variable sets it for the whole mesh:
`LLMMESH_MODEL` is the model for the engine and the text services, `LLMMESH_MAX_N` the `--max-n` limit everywhere.
`LLMMESH_SEED` is the engine's `--seed` (vLLM's); the seed each request carries is `--sampling-seed`
(`LLMMESH_SAMPLING_SEED`) of `llmmesh generate`, `llmmesh chat` and `llmmesh run-offline`.

The engine's flags have vLLM's names, defaults and meaning; [configuration.md](configuration.md) explains the
ports, the environment, the engine's settings that need more than a line and the KV connector's options. The
request limits (`--max-n` and the rest) are explained in [api.md](api.md#request-limits). Defaults shown as `unset`
mean the flag is off or taken from elsewhere (the model's own length, a profile of the device) as its meaning says;
`per command` means each command that takes the group gives its own, listed with the command.
"""

# The groups argparse makes of every parser: a command's own flags.
OWN_GROUPS = ("options", "positional arguments")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def meaning(action: argparse.Action) -> str:
    """The help text apply_env started from, without the default and variable it appended."""
    return (action.help or "").replace("%%", "%").removesuffix(config.help_suffix(action)).strip()


def _flag(action: argparse.Action) -> str:
    names = " / ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}` (positional)"
    if action.choices is not None and action.nargs != 0:
        names += "<br>one of " + ", ".join(f"`{c}`" for c in action.choices)
    return names


def _table(actions: list[argparse.Action], defaults: dict[str, str] | None = None) -> list[str]:
    """The flags' table; `defaults` (a dest's default as the table shows it) for a group shared by commands."""
    rows = ["| flag | default | variable | meaning |", "| --- | --- | --- | --- |"]
    for action in actions:
        if action.option_strings:
            default = (defaults or {}).get(action.dest) or f"`{config.default_text(action)}`"
            variable = f"`{config.env_name(action.dest)}`"
        else:
            default, variable = "required", ""
        rows.append(f"| {_flag(action)} | {_cell(default)} | {variable} | {_cell(meaning(action))} |")
    return rows


def _groups(parser: argparse.ArgumentParser) -> list:
    """The parser's argument groups that hold flags, but for --help."""
    return [
        (group, actions)
        for group in parser._action_groups
        if (actions := [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)])
    ]


def _shared(commands: dict[str, argparse.ArgumentParser]) -> dict[str, dict]:
    """Each group several commands share, by title: its description, actions, the commands that take it, and each
    flag's default (that of most of those commands, or `per command` when no default is most of theirs)."""
    shared: dict[str, dict] = {}
    for name, parser in commands.items():
        for group, actions in _groups(parser):
            if group.title not in OWN_GROUPS:
                entry = shared.setdefault(group.title, {"group": group, "actions": actions, "commands": {}})
                assert [a.dest for a in actions] == [a.dest for a in entry["actions"]], (name, group.title)
                entry["commands"][name] = {a.dest: config.default_text(a) for a in actions}
    for entry in shared.values():
        texts = list(entry["commands"].values())
        entry["defaults"] = {}
        for action in entry["actions"]:
            values = [t[action.dest] for t in texts]
            common = max(values, key=values.count)
            entry["defaults"][action.dest] = common if 2 * values.count(common) > len(values) else None
    return shared


def _command(name: str, parser: argparse.ArgumentParser, summary: str, shared: dict[str, dict]) -> list[str]:
    lines = [f"## llmmesh {name}", "", parser.description or summary, ""]
    takes, own = [], []
    for group, actions in _groups(parser):
        if group.title in OWN_GROUPS:
            own += actions
            continue
        entry = shared[group.title]
        differ = [
            f"`{a.option_strings[0]}` `{entry['commands'][name][a.dest]}`"
            for a in actions
            if entry["defaults"][a.dest] != entry["commands"][name][a.dest]
        ]
        link = f"[{group.title}](#{group.title.lower()})"
        takes.append(f"{link} (default {', '.join(differ)})" if differ else link)
    if takes:
        lines += ["Flag groups: " + ", ".join(takes) + ".", ""]
    if own:
        lines += [*_table(own), ""]
    return lines


def _group(title: str, entry: dict) -> list[str]:
    commands = ", ".join(f"[`{name}`](#llmmesh-{name})" for name in entry["commands"])
    defaults = {dest: f"`{text}`" if text is not None else "per command" for dest, text in entry["defaults"].items()}
    lines = [f"### {title}", "", entry["group"].description or "", "", f"Taken by {commands}.", ""]
    return [*lines, *_table(entry["actions"], defaults), ""]


def render() -> str:
    """The whole of docs/flags.md, from the parsers as they are with no LLMMESH_* variable set."""
    from services.cli import build_parser

    saved = {
        k: os.environ.pop(k)
        for k in list(os.environ)
        if k.startswith(config.ENV_PREFIX) or k == "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    }
    try:
        parser = build_parser()
    finally:
        os.environ.update(saved)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {choice.dest: choice.help for choice in subparsers._choices_actions}
    commands = dict(subparsers.choices)
    shared = _shared(commands)
    lines = [INTRO, "| command | what it does |", "| --- | --- |"]
    lines += [f"| [`llmmesh {name}`](#llmmesh-{name}) | {_cell(summaries.get(name) or '')} |" for name in commands]
    lines.append("")
    for name, command in commands.items():
        lines += _command(name, command, summaries.get(name) or "", shared)
    lines += ["## Flag groups", ""]
    for title, entry in shared.items():
        lines += _group(title, entry)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    PATH.write_text(render())
    print(f"wrote {PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
