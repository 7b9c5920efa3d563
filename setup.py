"""Builds gfpo_kernels._C: the CPU kernels always, the CUDA kernel when torch has CUDA and nvcc is found.

Build without isolation so the extension compiles against the torch already installed:
    pip install --no-build-isolation -e .
GFPO_NO_EXTENSION=1 skips the extension; the package then falls back to Triton / the PyTorch reference.
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("GFPO_NO_EXTENSION", "0") != "1":
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    cxx_flags = ["-O3", "-fopenmp"]
    sources = ["csrc/group_ops.cpp"]
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if with_cuda:
        ext = CUDAExtension(
            "gfpo_kernels._C",
            sources + ["csrc/group_ops_cuda.cu"],
            define_macros=[("GFPO_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension("gfpo_kernels._C", sources, extra_compile_args=cxx_flags, extra_link_args=["-fopenmp"])
    ext_modules = [ext]
    cmdclass = {"build_ext": BuildExtension}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
