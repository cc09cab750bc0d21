"""The C++ CPU kernels (kernels/cpu/: paged attention; the model's norm, RoPE and SiLU-and-mul layers; the
mixture-of-experts layer's experts; the few-row bfloat16 and float32 dense products and group-quantized products;
LoRA's shrink and expand; the sampler's argmax), one library, built once by setup and loaded at run time.

    .venv/bin/python -m kernels.cpu_ops    # build into build/kernels/ (the Makefile's setup step)

load() imports the built library without compiling; if it is missing or older than its sources, it builds
it first (once, with a log line). The build is tuned for the machine it runs on (-march=native), which is
the machine that uses it.
"""

import functools
import importlib.util
import logging
import os
import sys
from pathlib import Path

import torch

logger = logging.getLogger("llmmesh.kernels")

NAME = "llmmesh_cpu_ops"
SOURCES = sorted((Path(__file__).parent / "cpu").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "cpu").glob("*.h"))
BUILD_DIR = Path(__file__).resolve().parent.parent / "build" / "kernels"
LIBRARY = BUILD_DIR / f"{NAME}.so"

_module = None


def _flags() -> list[str]:
    # at::vec picks its instruction set from CPU_CAPABILITY, as in torch's own build.
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only"]
    if capability in ("AVX512", "AVX2"):
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    else:
        flags += ["-DCPU_CAPABILITY=DEFAULT"]
    return flags + ["-fopenmp"]


def build():
    from torch.utils import cpp_extension

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    # torch runs `ninja` from PATH; the venv's own (pip's ninja) is next to this interpreter.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.load(
        NAME,
        [str(s) for s in SOURCES],
        extra_cflags=_flags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(BUILD_DIR),
        verbose=False,
    )


def load():
    """The kernel module (paged_attention, reshape_and_cache, rms_norm, rotary_embedding, silu_and_mul, ...); loading
    it also registers the torch.ops namespaces of kernels/dense.py, kernels/quant.py, kernels/lora.py and the
    sampler's argmax."""
    global _module
    if _module is None:
        if not LIBRARY.exists() or LIBRARY.stat().st_mtime < max(s.stat().st_mtime for s in SOURCES + HEADERS):
            logger.info("Building the CPU kernels into %s (once)", BUILD_DIR)
            _module = build()
        else:
            spec = importlib.util.spec_from_file_location(NAME, LIBRARY)
            _module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(_module)
    return _module


@functools.cache  # a machine that cannot build them tries once
def try_load():
    """load(), or None where the kernels cannot be built: the callers' torch or oneDNN paths run instead."""
    try:
        return load()
    except Exception:  # noqa: BLE001 (any build or import failure means the same: no CPU kernels here)
        return None


if __name__ == "__main__":
    build()
    print(f"built {LIBRARY}")
