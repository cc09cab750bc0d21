"""docs/flags.md, written from the `llmmesh` command's own parsers: every command, every flag, its default and its
LLMMESH_* variable. tests/test_docs.py fails when the file in the repository differs from what this writes.

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

<!-- Written by `{COMMAND}` (or `make docs`) from the parsers in services/ and engine/config.py: do not edit by
hand; tests/test_docs.py fails when this file is out of date. -->

Every flag of every `llmmesh` command, as `llmmesh <command> --help` shows it. Every flag can also be set in the
environment as `LLMMESH_<NAME>` (the variable column): a switch takes `true`/`false` (`1`/`0`, `yes`/`no`,
`on`/`off`), a repeatable flag a comma-separated list, and a flag given on the command line wins over its variable.
A variable means the same flag in every command that has it, so one variable sets it for the whole mesh:
`LLMMESH_MODEL` is the model for the engine and the text services, `LLMMESH_MAX_N` the `--max-n` limit everywhere.
`LLMMESH_SEED` is the engine's `--seed` (vLLM's); the seed each request carries is `--sampling-seed`
(`LLMMESH_SAMPLING_SEED`) of `llmmesh generate`, `llmmesh chat` and `llmmesh run-offline`.

The engine's flags have vLLM's names, defaults and meaning; [configuration.md](configuration.md) explains the
ports, the environment, the engine's settings that need more than a line and the KV connector's options. The request limits (`--max-n` and the rest) are explained in
[api.md](api.md#request-limits). Defaults shown as `unset` mean the flag is off or taken from elsewhere (the
model's own length, a profile of the device) as its meaning says.
"""


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


def _table(actions: list[argparse.Action]) -> list[str]:
    rows = ["| flag | default | variable | meaning |", "| --- | --- | --- | --- |"]
    for action in actions:
        if action.option_strings:
            default, variable = f"`{config.default_text(action)}`", f"`{config.env_name(action.dest)}`"
        else:
            default, variable = "required", ""
        rows.append(f"| {_flag(action)} | {_cell(default)} | {variable} | {_cell(meaning(action))} |")
    return rows


def _command(name: str, parser: argparse.ArgumentParser, summary: str) -> list[str]:
    lines = [f"## llmmesh {name}", "", parser.description or summary, ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        if group.title not in ("options", "positional arguments"):
            lines += [f"*{group.title}*", ""]
        lines += [*_table(actions), ""]
    return lines


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
    names = list(subparsers.choices)
    lines = [INTRO, "| command | what it does |", "| --- | --- |"]
    lines += [f"| [`llmmesh {name}`](#llmmesh-{name}) | {_cell(summaries.get(name) or '')} |" for name in names]
    lines.append("")
    for name in names:
        lines += _command(name, subparsers.choices[name], summaries.get(name) or "")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    PATH.write_text(render())
    print(f"wrote {PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
