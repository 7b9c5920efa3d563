"""Builds gfpo_kernels._C on the LibTorch stable ABI: the CPU kernels always, the CUDA kernels when nvcc is found.

The extension compiles against the torch already installed, so build without isolation:
    pip install --no-build-isolation .          (-e . for a development install)
A plain (isolated) `pip install .` has no torch to compile against: it stops at once with one line saying so.
The sources see only the stable ABI of torch 2.10 (TORCH_TARGET_VERSION): built against any torch >= 2.10, CPU or
CUDA build, the binary loads in every torch from 2.10 on, CPU-only ones included (the CUDA runtime is linked
statically), and in every Python >= 3.10 (a cp310-abi3 wheel). docs/install.md has the details.

Environment:
    GFPO_NO_EXTENSION=1     no extension: the ops run on Triton or the PyTorch reference
    GFPO_CUDA=0 | 1         no CUDA kernels | CUDA kernels or stop (default: built when nvcc is found)
    TORCH_CUDA_ARCH_LIST    GPU architectures of the CUDA kernels, e.g. "8.0;9.0+PTX" (the default: A100, H100, and
                            PTX that newer GPUs compile when the kernel first loads)
A build records the commit, the torch built against, the CUDA version and architectures, or why there is no
extension, in gfpo_kernels/_build_info.py (git-ignored; a wheel carries its own); `python -m gfpo_kernels` prints it.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
BUILD_INFO = ROOT / "gfpo_kernels" / "_build_info.py"
# The oldest torch whose stable ABI has what csrc/ uses (parallel_for, empty/to/contiguous, str arguments).
STABLE_ABI = (2, 10)
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
# setup.py commands that compile (pip runs bdist_wheel / editable_wheel; metadata and sdist steps need no torch)
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install", "bdist_egg"}
# dist_info: the metadata pip asks of a wheel or editable build (never of an sdist) before it resolves and downloads
# the dependencies, so the earliest point where a build without torch can stop.
NEEDS_TORCH = BUILD_COMMANDS | {"dist_info"}
NO_TORCH = (
    "error: gfpo compiles its C++/CUDA extension against your installed torch, which pip's isolated build cannot "
    "see: with torch installed, run  pip install --no-build-isolation .  (or your sdist's path instead of .)"
)

# pyproject.toml's `license = "Apache-2.0"` and `license-files` (PEP 639) need setuptools 77; an older one, which a
# build without isolation takes from the environment (Python 3.11's venv brings 65.5), fails with a schema error
SETUPTOOLS_FLOOR = 77
OLD_SETUPTOOLS = (
    f"error: gfpo needs setuptools>={SETUPTOOLS_FLOOR} to build, this environment has {setuptools.__version__}: run  "
    f'pip install "setuptools>={SETUPTOOLS_FLOOR}"  and then the same pip install again'
)


def git_commit() -> str | None:
    """The checkout's commit (+dirty with uncommitted changes to tracked files), None outside a git checkout."""
    if not (ROOT / ".git").exists():  # an unpacked sdist: never the commit of some enclosing repository
        return None
    try:
        run = lambda *args: subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        sha = run("rev-parse", "--short=12", "HEAD").stdout.strip()
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


def recorded_commit() -> str:
    """The commit to record: git's, else the one an sdist carries in its build info, else "unknown"."""
    commit = git_commit()
    if commit is None and BUILD_INFO.exists():
        match = re.search(r"^COMMIT = '([^']*)'", BUILD_INFO.read_text(), re.MULTILINE)
        commit = match.group(1) if match else None
    return commit or "unknown"


def write_build_info(path: Path, **fields) -> None:
    lines = ['"""What this copy of gfpo was built from and with: written by setup.py (not in git)."""', ""]
    lines += [f"{name} = {value!r}" for name, value in fields.items()]
    path.write_text("\n".join(lines) + "\n")


def cuda_arch_flags(arch_list: str) -> list[str]:
    """nvcc -gencode flags for "8.0;9.0+PTX"-style lists: SASS for each, PTX too for those marked +PTX."""
    flags = []
    for arch in filter(None, re.split(r"[;\s]+", arch_list)):
        match = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)(\+PTX)?", arch)
        if match is None:
            sys.exit(f"gfpo: TORCH_CUDA_ARCH_LIST entries look like 8.0 or 9.0+PTX, got {arch!r}")
        num = match.group(1) + match.group(2) + match.group(3)
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if match.group(4):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def find_cuda_home() -> Path | None:
    """The CUDA toolkit holding nvcc: $CUDA_HOME or $CUDA_PATH, else /usr/local/cuda, else nvcc's on PATH."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    return next((Path(c) for c in candidates if c and Path(c, "bin", "nvcc").exists()), None)


def extension_build():
    """(ext_modules, cmdclass, build-info fields) for this build."""
    if os.environ.get("GFPO_NO_EXTENSION", "0") == "1":
        return [], {}, {"EXTENSION": "disabled", "EXTENSION_NOTE": "GFPO_NO_EXTENSION=1 at build time"}
    import torch
    from torch.utils import cpp_extension

    info = {"TORCH": torch.__version__, "STABLE_ABI": "%d.%d" % STABLE_ABI}
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < STABLE_ABI:
        note = f"torch {torch.__version__} at build time; the extension needs torch>=%d.%d" % STABLE_ABI
        print(f"gfpo: building without the extension: {note}")
        return [], {}, {"EXTENSION": "not built", "EXTENSION_NOTE": note, **info}

    cuda_home = find_cuda_home()
    want_cuda = os.environ.get("GFPO_CUDA")
    if want_cuda == "1" and cuda_home is None:
        sys.exit("gfpo: GFPO_CUDA=1 but nvcc was not found (set CUDA_HOME, or put nvcc on PATH)")
    with_cuda = cuda_home is not None and want_cuda != "0"
    if with_cuda:
        nvcc_version = subprocess.check_output([str(cuda_home / "bin" / "nvcc"), "--version"], text=True)
        release = re.search(r"release (\d+\.\d+)", nvcc_version).group(1)
        # A CUDA torch runs on a driver for its CUDA major version, which may not run kernels of another major
        # (torch itself refuses to compile .cu files with such an nvcc): leave the CUDA kernels out, and say so.
        if torch.version.cuda and torch.version.cuda.split(".")[0] != release.split(".")[0]:
            note = f"nvcc {release} ({cuda_home}) and torch's CUDA {torch.version.cuda} differ in major version"
            if want_cuda == "1":
                sys.exit(f"gfpo: GFPO_CUDA=1 but {note}: point CUDA_HOME at a CUDA {torch.version.cuda} toolkit")
            print(f"gfpo: building without CUDA kernels: {note} (the group ops then run on Triton on the GPU)")
            info["CUDA_NOTE"] = f"no CUDA kernels: {note}"
            with_cuda = False
    target = "-DTORCH_TARGET_VERSION=0x%02X%02X000000000000" % STABLE_ABI  # headers show the 2.10 stable ABI only
    # Hidden by default, as torch::stable and torch::headeronly are: _C.so exports its module init function only.
    cxx_flags = ["-O3", "-fvisibility=hidden", target]
    nvcc_flags, extra_objects, libraries = [], [], []
    sources = ["csrc/group_ops.cpp"]
    if with_cuda:
        # torch compiles .cu files with $CUDA_HOME/bin/nvcc, and leaves CUDA_HOME unset in a CPU build of torch;
        # the stable-ABI kernels need nothing of torch's CUDA, so a CPU torch builds them too.
        cpp_extension.CUDA_HOME = str(cuda_home)
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCHS
        info.update(CUDA=release, CUDA_ARCHS=archs)
        sources.append("csrc/group_ops_cuda.cu")
        cxx_flags.append("-DGFPO_WITH_CUDA")
        nvcc_flags = ["-O3", "-Xcompiler=-fvisibility=hidden", target, *cuda_arch_flags(archs)]
        # The CUDA runtime linked in statically: no libcudart.so to find, so _C.so loads beside a CPU-only torch
        # too (its CUDA kernels registered, never called there), and beside any CUDA torch whose driver runs it.
        extra_objects = [str(cuda_home / "lib64" / "libcudart_static.a")]
        if not Path(extra_objects[0]).exists():
            sys.exit(f"gfpo: {extra_objects[0]} not found: the CUDA kernels link the CUDA runtime statically "
                     "(install the toolkit's static runtime, or build without them: GFPO_CUDA=0)")
        libraries = ["dl", "rt", "pthread"]
    else:
        info.update(CUDA=None, CUDA_ARCHS=None)
    extension = Extension(
        "gfpo_kernels._C",
        sources,
        language="c++",
        include_dirs=cpp_extension.include_paths(),
        library_dirs=cpp_extension.library_paths(),
        # libtorch_cpu holds the stable C shim, the only part of torch _C.so calls. libstdc++ first, so the C++
        # runtime's symbols bind to it (versioned) and not to the copies libtorch exports.
        libraries=["stdc++", *libraries, "torch_cpu"],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        # Keep the symbols of static archives private to _C.so: a compiler that links libstdc++ statically (the GPU
        # image's g++ does) otherwise exports ~4000 std:: symbols that clash with torch's (a TORCH_CHECK message
        # segfaulted on the H100 run of 2026-11-23); the static CUDA runtime's stay private too.
        extra_link_args=["-Wl,--exclude-libs,ALL"] if sys.platform.startswith("linux") else [],
        extra_objects=extra_objects,
        py_limited_api=True,  # the module stub uses the limited C API only: one wheel for every Python >= 3.10
    )
    return [extension], {"build_ext": cpp_extension.BuildExtension}, {"EXTENSION": "built", "EXTENSION_NOTE": None, **info}


class SdistWithBuildInfo(sdist):
    """An sdist carries the commit it was made from (it has no .git): the wheel built from it records that."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        target = Path(base_dir, "gfpo_kernels", "_build_info.py")
        target.unlink(missing_ok=True)  # a copy of this tree's own build's, which is not the sdist's
        write_build_info(target, COMMIT=recorded_commit(), EXTENSION="not built", EXTENSION_NOTE="an sdist")


class BuildPyWithBuildInfo(build_py):
    """A wheel's build record goes into the wheel: the source tree's describes the tree's own in-place build."""

    def run(self):
        super().run()
        if RECORD is not None and not IN_PLACE:
            write_build_info(Path(self.build_lib, "gfpo_kernels", "_build_info.py"), **RECORD)


commands = set(sys.argv[1:])
if int(setuptools.__version__.split(".")[0]) < SETUPTOOLS_FLOOR:
    sys.exit(OLD_SETUPTOOLS)
if commands & NEEDS_TORCH and os.environ.get("GFPO_NO_EXTENSION", "0") != "1" and not importlib.util.find_spec("torch"):
    sys.exit(NO_TORCH)
# editable installs and build_ext --inplace put _C beside the sources; a wheel build puts it into build/
IN_PLACE = bool(commands & {"editable_wheel", "develop"}) or bool({"--inplace", "-i"} & commands)
ext_modules, options, RECORD = [], {}, None
cmdclass = {"sdist": SdistWithBuildInfo, "build_py": BuildPyWithBuildInfo}
if commands & BUILD_COMMANDS:
    commit = recorded_commit()  # before anything is written: an sdist's comes from its build record
    ext_modules, build_cmdclass, info = extension_build()
    cmdclass.update(build_cmdclass)
    if ext_modules:
        options = {"bdist_wheel": {"py_limited_api": "cp310"}}
    RECORD = {"COMMIT": commit, **info}
    if IN_PLACE:
        write_build_info(BUILD_INFO, **RECORD)
        # an older in-place build named for one Python (_C.cpython-311-*.so) would be imported before _C.abi3.so
        for stale in (ROOT / "gfpo_kernels").glob("_C.cpython-*.so"):
            stale.unlink()

setup(ext_modules=ext_modules, cmdclass=cmdclass, options=options)
