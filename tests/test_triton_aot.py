"""The Triton kernels compile for the GPUs CI does not have (sm_90: H100/H200, sm_80: A100), at the configurations
the wrappers launch, without spilling registers: ahead-of-time compilation with Triton's bundled ptxas.

The compilation runs once, in a process of its own without TRITON_INTERPRET (the CPU tests set it, and Triton 3.9's
interpreter mode breaks compilation in the process that set it): scripts/triton_aot.py --quick --json."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gfpo_test_utils import subprocess_env

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

REPO = Path(__file__).parents[1]
ARCHS = (90, 80)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """{(launch name, arch): ptxas resource usage and half-precision conversions} for every quick launch."""
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = subprocess_env()
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "triton_aot.py"), "--quick", "--json", str(out),
                           "--arch", *map(str, ARCHS)], env=env, capture_output=True, text=True, timeout=600)
    if not out.exists():  # a compile error: the script raised before writing
        pytest.fail(f"scripts/triton_aot.py failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return {(r["name"], r["arch"]): r for r in json.loads(out.read_text())}


def _launch_names():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import triton_aot
    finally:
        sys.path.pop(0)
    return [launch.name for launch in triton_aot.launches(quick=True)]


NAMES = _launch_names()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", NAMES)
def test_kernel_compiles_without_spilling(compiled, name, arch):
    usage = compiled[(name, arch)]
    assert usage["registers"] <= 255
    # ptxas may park one 4-byte value (seen at 48 registers, G=256 on sm_80); more is register pressure. A 4096-wide
    # group at 4 warps spilled 20 bytes on sm_90 before the warps grew with the tile.
    assert usage["spill_stores"] <= 4, usage


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("out", ["bf16", "fp16"])
@pytest.mark.parametrize("kernel", ["grad-logits", "scale-into", "scale-in-place"])
def test_half_outputs_round_to_nearest_even_on_the_gpu(compiled, arch, out, kernel):
    """The grad-logits kernel (the fp32 gradient into a half buffer), the scale-into kernel (the gradient
    accumulators into the parameters' dtype) and the scale-in-place kernel (a half gradient times the incoming
    gradient) convert with round-to-nearest-even, as torch's .to() does (the interpreter the CPU tests run truncates
    to bf16 instead, so only the PTX can show it)."""
    names = [n for n in NAMES if n.startswith(kernel + " ") and
             (n.endswith(f"-> {out}") or n.endswith(f"-> {out} softcap") or n == f"{kernel} {out}")]
    assert len(names) == (2 if kernel == "grad-logits" else 1)  # grad-logits: without and with the logit soft cap
    for name in names:
        conversions = compiled[(name, arch)]["half_conversions"]
        assert conversions and all(c.startswith("cvt.rn.") for c in conversions), (name, conversions)
    for in_place in (n for n in NAMES if n.startswith("grad-logits") and "-> fp32" in n):
        assert compiled[(in_place, arch)]["half_conversions"] == []


def test_wide_groups_get_more_warps():
    """The warps grow with the tile (at most 8 elements a thread), and tiles of up to 1024 keep 4 warps."""
    from gfpo_kernels.group_ops_triton import launch_config

    assert launch_config(4096, 16) == (64, 16, 4)
    assert launch_config(3, 16) == (4, 16, 4)
    assert launch_config(100, 2048) == (1, 2048, 8)
    assert launch_config(100, 4096) == (1, 4096, 16)
