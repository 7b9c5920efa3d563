"""Builds gfpo_kernels._C: the CPU kernels always, the CUDA kernel when torch has CUDA and nvcc is found.

Build without isolation so the extension compiles against the torch already installed:
    pip install --no-build-isolation -e .
GFPO_NO_EXTENSION=1 skips the extension; the package then falls back to Triton / the PyTorch reference.
"""

import os
import sys

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("GFPO_NO_EXTENSION", "0") != "1":
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    cxx_flags = ["-O3", "-fopenmp"]
    # Keep symbols of static archives private to the extension. A compiler wrapper that links libstdc++ statically
    # (the GPU image's /opt/gcc/bin/g++ does) otherwise exports ~4000 std:: symbols from _C.so, which then clash
    # with torch's libstdc++: formatting an integer into a TORCH_CHECK message segfaulted (H100 run, 2026-11-23).
    link_flags = ["-fopenmp"] + (["-Wl,--exclude-libs,ALL"] if sys.platform.startswith("linux") else [])
    sources = ["csrc/group_ops.cpp"]
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if with_cuda:
        ext = CUDAExtension(
            "gfpo_kernels._C",
            sources + ["csrc/group_ops_cuda.cu"],
            define_macros=[("GFPO_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            extra_link_args=link_flags,
        )
    else:
        ext = CppExtension("gfpo_kernels._C", sources, extra_compile_args=cxx_flags, extra_link_args=link_flags)
    ext_modules = [ext]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
