"""The documentation against the code: the generated flags reference is current, --help shows each default and
variable, one port scheme holds everywhere, every link resolves inside the repository, and the commands of the
README's quickstart and docs/api.md's examples run as written against a real mesh (grpcurl's examples with a real
grpcurl where one is installed, else the same calls made from their JSON through the protos' own descriptors)."""

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_health.v1 import health_pb2  # noqa: F401 (its descriptors, for the health example)

from engine.config import EngineArgs
from llmmesh.v1 import gateway_pb2  # noqa: F401 (its descriptors, for the gateway examples)
from services import client, config, docs_sections, flags_doc
from services.cli import build_parser, main
from services.local_mesh import Mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import report  # benchmarks/report.py: docs/benchmarks.md's figures from docs/benchmarks/

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "design").glob("*.md")),
]
DOC_ADDRESS = f"127.0.0.1:{config.DEFAULT_PORTS['gateway']}"  # where the examples call the gateway
API_KEY = "KEY"  # the key docs/api.md's LLMMESH_API_KEY example sends
DOC_CA = "~/.local/state/llmmesh/tls/ca.crt"  # the CA the grpcurl examples trust (-cacert): `llmmesh serve`'s default


def subcommands():
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def fenced(text: str, language: str | None = None) -> list[str]:
    """The bodies of the ``` blocks (of one language, if given)."""
    return [
        body
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
        if language is None or lang == language
    ]


def prose(text: str) -> str:
    """The text without its code blocks (a `# comment` in a shell block is no heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


# ---- the generated reference, --help, ports ------------------------------------------------------------


def test_flags_doc_is_current():
    if (ROOT / "docs" / "flags.md").read_text() != flags_doc.render():
        pytest.fail(
            f"docs/flags.md is out of date with the parsers: run `.venv/bin/{flags_doc.COMMAND}` (or `make "
            "docs`) and commit the result"
        )


@pytest.mark.parametrize("page", list(docs_sections.SECTIONS))
def test_generated_sections_are_current(page):
    """The request limits, the metrics and the restart policy, as the code defines them."""
    text = (ROOT / "docs" / page).read_text()
    if text != docs_sections.render(page, text):
        pytest.fail(
            f"a generated section of docs/{page} is out of date with the code: run "
            f"`.venv/bin/{docs_sections.COMMAND}` (or `make docs`) and commit the result"
        )


def test_benchmark_report_is_current():
    """docs/benchmarks.md's summary, machines and sections, and docs/benchmarks/tables.md, as the results under
    docs/benchmarks/ give them."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    if text != report.render(text) or report.TABLES.read_text() != report.tables_page():
        pytest.fail(
            f"docs/benchmarks.md is out of date with docs/benchmarks/results/: run `.venv/bin/{report.COMMAND}` (or "
            "`make docs`) and commit the result"
        )


def png_text(path: Path) -> dict[str, str]:
    """A PNG's tEXt chunks, key -> value."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    chunks, i = {}, 8
    while i < len(data):
        length, kind = struct.unpack(">I4s", data[i : i + 8])
        if kind == b"tEXt":
            key, _, value = data[i + 8 : i + 8 + length].partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        i += 12 + length
    return chunks


def test_benchmark_plots_are_current():
    """Each plot was drawn from its result's tables as they are now, and each result names a known machine."""
    machines = report.machines()
    plotted = 0
    for name, result in report.results().items():
        assert result["machine"] is None or result["machine"] in machines, (name, result["machine"])
        for plot in result.get("plots", []):
            path = report.DATA / plot["file"]
            assert path.is_file(), f"docs/benchmarks/{plot['file']} is missing: run `make docs`"
            drawn_from = png_text(path).get(report.DIGEST_KEY)
            assert drawn_from == report.plot_digest(result), (
                f"docs/benchmarks/{plot['file']} is older than docs/benchmarks/results/{name}.json: run `make docs` "
                "(or build/docs/bin/python benchmarks/plots.py) and commit the result"
            )
            plotted += 1
    assert plotted >= 8
    drawn = {p["file"] for r in report.results().values() for p in r.get("plots", [])}
    assert {p.name for p in report.DATA.glob("*.png")} == drawn, "a plot under docs/benchmarks/ that no result draws"


def test_flags_doc_describes_each_group_once():
    """A group of flags several commands take has one table, and each command that takes it links to it."""
    text = (ROOT / "docs" / "flags.md").read_text()
    sections = dict(re.findall(r"^## llmmesh (\S+)\n(.*?)(?=^## )", text, re.DOTALL | re.MULTILINE))
    for name, parser in subcommands().items():
        for group in parser._action_groups:
            if group.title in flags_doc.OWN_GROUPS or not group._group_actions:
                continue
            assert text.count(f"\n### {group.title}\n") == 1, group.title
            assert f"[{group.title}](#{group.title.lower()})" in sections[name], (name, group.title)
    assert text.count("| `--max-n` |") == text.count("| `--block-size` |") == 1


def test_help_shows_each_meaning_default_and_variable():
    for name, parser in subcommands().items():
        for action in parser._actions:
            if action.dest == "help":
                continue
            assert flags_doc.meaning(action), f"llmmesh {name} {action.dest}: give the flag a help= text"
            if action.option_strings:
                assert action.help.replace("%%", "%").endswith(config.help_suffix(action)), (name, action.dest)
    shown = " ".join(subcommands()["gateway"].format_help().split())
    assert f"0: any free port (default: {config.DEFAULT_PORTS['gateway']}) [env LLMMESH_PORT]" in shown
    assert "(default: 1024) [env LLMMESH_MAX_REQUESTS_IN_FLIGHT]" in shown
    assert "(default: off) [env LLMMESH_TRUST_REQUEST_CHAT_TEMPLATE]" in shown


def test_one_port_scheme():
    """Each service's port is its DEFAULT_PORTS entry standing alone, under compose, in the image and in the docs'
    table; `llmmesh serve` and the clients use the gateway's."""
    commands = subcommands()
    for name, port in config.DEFAULT_PORTS.items():
        assert commands[name].get_default("port") == port, name
    assert commands["serve"].get_default("port") == config.DEFAULT_PORTS["gateway"]
    assert commands["generate"].get_default("address") == client.DEFAULT_ADDRESS == DOC_ADDRESS

    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name, port in config.DEFAULT_PORTS.items():
        command = services[name]["command"]
        assert str(command[command.index("--port") + 1]) == str(port), f"compose.yaml: {name}"
        assert services[name]["healthcheck"]["test"][-1] == f"127.0.0.1:{port}", f"compose.yaml: {name}"
    assert services["gateway"]["ports"] == [f"{config.DEFAULT_PORTS['gateway']}:{config.DEFAULT_PORTS['gateway']}"]
    assert re.search(rf"^EXPOSE {config.DEFAULT_PORTS['gateway']}$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)

    rows = {}
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and len(cells) > 1:
            rows[cells[0].split(" ")[0]] = cells[1]
    for name, port in config.DEFAULT_PORTS.items():
        assert rows.get(name) == str(port), f"docs/configuration.md's port table: {name}"


# ---- links and words ---------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", prose(path.read_text()), re.MULTILINE):
        name = slug(heading)
        seen[name] = seen.get(name, -1) + 1
        if seen[name]:
            name = f"{name}-{seen[name]}"
        seen.setdefault(name, 0)
    return set(seen)


def test_links_stay_in_the_repository_and_resolve():
    checked = 0
    for page in PAGES:
        text = prose(page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            where = f"{page.relative_to(ROOT)}: ({target})"
            assert not re.match(r"[a-z]+:", target), f"{where}: docs link to nothing outside the repository"
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.is_relative_to(ROOT) and file.exists(), f"{where}: no such file"
            if anchor:
                assert file.suffix == ".md" and anchor in anchors(file), f"{where}: no such heading"
            checked += 1
        assert "../shared" not in page.read_text() and "DESIGN §" not in page.read_text(), page
    assert checked > 50


def test_the_docs_speak_of_the_project_only():
    words = re.compile(r"\bissues? \d+|\bsessions?\b|\bhelpers?\b|can_start_another", re.IGNORECASE)
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not words.search(line), f"{page.relative_to(ROOT)}:{number}: {line}"


# What the git log keeps: a commit hash (7 to 12 hex digits, or 40), a time of day, a machine's load.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b")
TIME_OF_DAY = re.compile(r"(?<![\d:.])(?:[01]?\d|2[0-3]):[0-5]\d(?![\d:])")
LOAD = re.compile(r"\bload averages?\b|\bload (?:of |about |at )?\d|\buptime\b", re.IGNORECASE)


def test_the_docs_hold_no_commit_hash_time_of_day_or_load():
    """The docs say what holds now; when it was measured, at which commit and on how busy a machine is history.
    CHANGELOG.md may carry dates, but no hashes."""
    files = [*PAGES, *sorted((ROOT / "docs" / "benchmarks").rglob("*.json"))]
    checks = [(path, (COMMIT_HASH, TIME_OF_DAY, LOAD)) for path in files] + [(ROOT / "CHANGELOG.md", (COMMIT_HASH,))]
    for path, patterns in checks:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in patterns:
                found = pattern.search(line)
                assert not found, f"{path.relative_to(ROOT)}:{number}: {found.group(0)!r} in {line.strip()[:160]}"


def test_the_history_check_sees_history():
    for line in ("at commit 680cbf0", "06:28–06:32", "load average 1.5", "load 0.9 at the start", "(4d7b1e1)"):
        assert any(p.search(line) for p in (COMMIT_HASH, TIME_OF_DAY, LOAD)), line
    for line in ("port 127.0.0.1:50051", "8000:8000", "1,024 tokens", "request_id 6620f43e2a424f2c9b3d973e8b65e4d5"):
        assert not any(p.search(line) for p in (COMMIT_HASH, TIME_OF_DAY, LOAD)), line


# ---- the commands, as written --------------------------------------------------------------------------------


def console_commands(text: str):
    """(argv, the line as written, the output shown under it) for each `$ ` line of the ```console blocks."""
    for block in fenced(text, "console"):
        lines, i = block.splitlines(), 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                i += 1
                continue
            command, i = lines[i][2:], i + 1
            while command.endswith("\\") or not _splits(command):  # a continued line, or a quote still open
                command, i = command + "\n" + lines[i], i + 1
            output = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("$ ", "#")):
                output, i = output + [lines[i]], i + 1
            yield shlex.split(command.replace("\\\n", " ")), command, output


def _splits(command: str) -> bool:
    try:
        shlex.split(command)
        return True
    except ValueError:
        return False


def readme_quickstart() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in fenced(section, "sh"):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(shlex.split(line))
    return commands


def test_readme_quickstart_commands_are_real():
    """Each make target exists and each llmmesh command parses (the mesh test below runs the client ones)."""
    commands = readme_quickstart()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    assert {"make"} <= {argv[0] for argv in commands}
    for argv in commands:
        if argv[0] == "make":
            assert set(argv[1:]) <= targets, argv
        else:
            assert Path(argv[0]).name == "llmmesh", f"README quickstart: {argv} is neither make nor llmmesh"
            build_parser().parse_args(argv[1:])


def run_llmmesh(argv: list[str]) -> tuple[int, str, str]:
    """`llmmesh <argv>` through the command's own entry point, in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code or 0
    return code, out.getvalue(), err.getvalue()


def json_objects(text: str) -> list:
    decoder, objects, i = json.JSONDecoder(), [], 0
    while (start := text.find("{", i)) != -1:
        obj, i = decoder.raw_decode(text, start)
        objects.append(obj)
    return objects


def without_volatile(obj):
    """A response without what changes from run to run (ids, timings)."""
    if isinstance(obj, dict):
        return {k: without_volatile(v) for k, v in obj.items() if k not in ("request_id", "timings")}
    if isinstance(obj, list):
        return [without_volatile(v) for v in obj]
    return obj


def grpcurl_binary() -> str | None:
    return shutil.which("grpcurl") or shutil.which("grpcurl", path=os.path.dirname(sys.executable))


def emulate_grpcurl(argv: list[str]) -> tuple[int, str]:
    """What `grpcurl [-plaintext | -cacert ca] [-H h] [-max-time t] [-d json] ADDRESS METHOD` does, from the method's
    descriptor in the generated protos: the JSON parsed into its request message (an unknown field fails, as in
    grpcurl), the call made over TLS (the server's certificate checked against ca) or plaintext, the responses printed
    as JSON, an error as grpcurl prints it."""
    args, metadata, timeout, body, plaintext, ca = list(argv[1:]), [], None, "{}", False, None
    while args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "-plaintext":
            plaintext = True
        elif flag == "-cacert":
            ca = Path(args.pop(0)).read_bytes()
        elif flag == "-H":
            metadata.append(tuple(part.strip() for part in args.pop(0).split(":", 1)))
        elif flag == "-max-time":
            timeout = float(args.pop(0))
        elif flag == "-d":
            body = args.pop(0)
    if args[1] in ("list", "describe"):
        return 0, ""  # the server's reflection, which only grpcurl itself shows
    address, method = args
    service, name = method.rsplit("/", 1)
    descriptor = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
    request_class = message_factory.GetMessageClass(descriptor.input_type)
    response_class = message_factory.GetMessageClass(descriptor.output_type)
    request = json_format.Parse(body, request_class())
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    with grpc.insecure_channel(address) if plaintext else grpc.secure_channel(address, credentials) as channel:
        kind = channel.unary_stream if descriptor.server_streaming else channel.unary_unary
        call = kind(
            f"/{method}",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        try:
            replies = call(request, timeout=timeout, metadata=metadata or None)
            replies = list(replies) if descriptor.server_streaming else [replies]
        except grpc.RpcError as e:
            code = "".join(word.title() for word in e.code().name.split("_"))
            return 1, f"ERROR:\n  Code: {code}\n  Message: {e.details()}\n"
    return 0, "".join(json_format.MessageToJson(r, preserving_proto_field_name=True) + "\n" for r in replies)


@pytest.fixture(scope="module")
def mesh():
    with Mesh(EngineArgs(kv_cache_memory="1GiB")) as mesh:
        with pytest.MonkeyPatch.context() as patch:  # a key travels in the environment, never on a command line
            patch.setenv("LLMMESH_API_KEY", API_KEY)
            gateway_with_key = mesh.start_gateway([])
        try:
            yield mesh, gateway_with_key.address
        finally:
            gateway_with_key.stop()


@pytest.mark.slow
def test_readme_and_api_examples_against_a_mesh(mesh, tmp_path):
    mesh, keyed_address = mesh
    api = (ROOT / "docs" / "api.md").read_text()
    ran = []

    # The README's quickstart: its llmmesh client commands, at this mesh.
    for argv in readme_quickstart():
        if argv[0] != "make" and argv[1] in ("generate", "chat"):
            code, out, err = run_llmmesh([*argv[1:], "--address", mesh.address])
            assert code == 0 and out.strip() and "[finish_reason=" in err, (argv, out, err)
            ran.append(argv)

    # docs/api.md's Python example, on protos generated the way it says ("Elsewhere, generate them...").
    (tmp_path / "protos").symlink_to(ROOT / "protos")
    example = next(block for block in fenced(api, "python") if "gateway_pb2_grpc.GatewayStub" in block)
    (tmp_path / "example.py").write_text(example)
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    for argv, line, _ in console_commands(api):
        if argv[0] == "mkdir" or argv[:3] == ["python", "-m", "grpc_tools.protoc"]:
            subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, check=True)
            ran.append(argv)
        elif argv[0] == "export":
            variable, value = argv[1].split("=", 1)
            env[variable] = str(tmp_path / value)
    assert (tmp_path / "gen" / "llmmesh" / "v1" / "gateway_pb2_grpc.py").is_file()
    printed = subprocess.run(
        [sys.executable, "example.py", mesh.address],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    expected = fenced(api.split("with the default model it prints:", 1)[1], "text")[0]
    assert printed.returncode == 0 and printed.stdout == expected, (printed.stdout, printed.stderr)

    # Every llmmesh and grpcurl command of its console blocks.
    grpcurl = grpcurl_binary()
    for argv, line, shown in console_commands(api):
        if argv[0] == "llmmesh" and argv[1] in ("generate", "chat", "health"):
            if argv[1] == "health":
                argv = [a if a != DOC_ADDRESS else mesh.address for a in argv]
            else:
                argv = [*argv, "--address", mesh.address]
            code, out, err = run_llmmesh(argv[1:])
            assert code == 0, (line, out, err)
        elif argv[0] == "llmmesh":
            assert build_parser().parse_args(argv[1:]), line  # serve, and the other services: they parse
            continue
        elif argv[0] == "grpcurl":
            address = keyed_address if f"Bearer {API_KEY}" in line else mesh.address
            ca = os.path.join(mesh.tls_dir, "ca.crt")
            argv = [address if a == DOC_ADDRESS else ca if a == DOC_CA else a for a in argv]
            if grpcurl:
                done = subprocess.run([grpcurl, *argv[1:]], capture_output=True, text=True, timeout=60, check=False)
                code, out = done.returncode, done.stdout + done.stderr
            else:
                code, out = emulate_grpcurl(argv)
            check_output(line, shown, code, out, exact_errors=grpcurl is not None)
        else:
            continue  # pip, mkdir, protoc, export (run above); smg and curl: tests/test_interop.py runs them
        ran.append(argv)
    assert sum(argv[0] == "grpcurl" for argv in ran) >= 10 and len(ran) >= 15, ran


def check_output(line: str, shown: list[str], code: int, out: str, exact_errors: bool) -> None:
    """The output a doc shows under a command, against what it printed: the same error, the same listed names, or
    every JSON message shown (less ids and timings) among those printed."""
    shown_text = "\n".join(shown)
    if "ERROR:" in shown_text:
        assert code != 0, (line, out)
        for expected in shown[1:]:
            # A deadline's message depends on which timer fires first: grpcurl's own ("context deadline exceeded")
            # or the server's, whose status can arrive first on a busy machine ("Deadline Exceeded").
            deadline_message = "DeadlineExceeded" in shown_text and "Message:" in expected
            if (exact_errors and not deadline_message) or "Code:" in expected or "InvalidArgument" in shown_text:
                assert expected.strip() in out, (line, expected, out)
        return
    assert code == 0, (line, out)
    if not shown:
        return
    if not shown[0].lstrip().startswith("{"):
        if exact_errors:  # the services a server lists by reflection
            assert set(out.split()) == {s.strip() for s in shown}, (line, out)
        return
    printed = [without_volatile(obj) for obj in json_objects(out)]
    for expected in json_objects(shown_text.replace("…", "")):
        assert without_volatile(expected) in printed, (line, expected, printed)


def test_security_doc_holds_the_table_of_callers_the_servers_enforce():
    from mesh.tls import callers_table

    assert callers_table() in (ROOT / "docs" / "security.md").read_text()
