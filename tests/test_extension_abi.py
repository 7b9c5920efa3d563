"""gfpo_kernels._C needs nothing of libtorch but the LibTorch stable ABI, so one binary serves every torch from the
one it targets (2.10) on: read off the built library's dynamic section and symbol table (binutils' nm, readelf).
Loading it under other torch versions is scripts/cross_torch.sh's job (docs/install.md has its results)."""

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from gfpo_kernels import _dispatch

pytestmark = pytest.mark.skipif(
    not _dispatch.HAS_CPP or shutil.which("nm") is None or shutil.which("readelf") is None,
    reason="needs the built extension and binutils (nm, readelf)",
)

TORCH_INCLUDE = Path(torch.__file__).parent / "include" / "torch"
# The C shim of the stable ABI: every function _C.so may take from libtorch is declared here.
SHIM_HEADER_DIRS = (TORCH_INCLUDE / "csrc" / "inductor" / "aoti_torch" / "c", TORCH_INCLUDE / "csrc" / "stable" / "c")
# libtorch_cpu.so holds the shim; libtorch_cuda.so, libc10*.so, libtorch_python.so and a shared CUDA runtime would
# tie the binary to one torch build (and a CUDA build to CUDA torches).
ALLOWED_TORCH_LIBRARIES = {"libtorch_cpu.so"}
TORCH_LIBRARY = re.compile(r"lib(torch|c10|cudart|caffe2)")
# Unversioned symbols the toolchain itself references weakly (transactional memory, gprof, C++ runtime teardown).
TOOLCHAIN_WEAK = {"_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable", "__gmon_start__", "__cxa_finalize"}
# Symbol versions of the C library and the C++ runtime (libstdc++, libgcc): torch versions none of its symbols.
SYSTEM_VERSIONS = ("GLIBC_", "GLIBCXX_", "CXXABI_", "GCC_")


def shim_functions() -> set[str]:
    names = set()
    for directory in SHIM_HEADER_DIRS:
        for header in directory.glob("*.h"):
            names |= set(re.findall(r"AOTI_TORCH_EXPORT\s+[\w\s*]*?(\w+)\s*\(", header.read_text()))
    return names


def abi_violations(library: Path) -> list[str]:
    """What in `library` reaches outside the stable ABI: libraries of torch other than libtorch_cpu, C++ symbols
    not from the C++ runtime (c10::, at::, torch:: ...), and C symbols neither from the system, nor Python's, nor
    declared in the stable C shim."""
    problems = []
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    for needed in re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic):
        if TORCH_LIBRARY.match(needed) and needed not in ALLOWED_TORCH_LIBRARIES:
            problems.append(f"links {needed}")
    shim = shim_functions()
    table = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True)
    for line in table.stdout.splitlines():
        kind, symbol = line.split()
        name, _, version = symbol.partition("@")
        if version.startswith(SYSTEM_VERSIONS):
            continue
        if name.startswith("_Z"):  # C++ (c10::, at::, torch:: ...): not from the C++ runtime, so from libtorch
            problems.append(f"C++ symbol not from the C++ runtime: {symbol}")
        elif not (name.startswith(("Py", "_Py")) or name in shim or (kind == "w" and name in TOOLCHAIN_WEAK)):
            problems.append(f"C symbol outside the stable C shim: {symbol}")
    return problems


def test_extension_uses_only_the_stable_abi():
    library = Path(importlib.util.find_spec("gfpo_kernels._C").origin)
    assert len(shim_functions()) > 100  # the headers were found and parsed
    assert abi_violations(library) == [], library
