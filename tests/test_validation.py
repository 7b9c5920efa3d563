"""Bad input: every backend and the reference refuse it with a ValueError that names the argument and the
value."""

import pytest
import torch

import gfpo_kernels
from gfpo_kernels import reference as ref

from gfpo_test_utils import DEVICE

IMPLS = ["kernels", "reference"]


def _ops(impl):
    return gfpo_kernels if impl == "kernels" else ref


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, x: m.group_topk_mask(x(10), 4, 2), r"N=10 rows, which is not a multiple of group_size=4"),
        (lambda m, x: m.group_topk_mask(x(8), 4, 0), r"1 <= k <= group_size=4, got k=0"),
        (lambda m, x: m.group_topk_mask(x(8), 4, 5), r"1 <= k <= group_size=4, got k=5"),
        (lambda m, x: m.group_topk_mask(x(8), 4, 2.0), r"k must be an int or an integer tensor, got k=2.0"),
        (lambda m, x: m.group_topk_mask(x(8), 4, True), r"got k=True"),
        (lambda m, x: m.group_topk_mask(x(8), 4, torch.tensor([1, 2, 3])), r"shape \(num_groups,\) = \(2,\), got shape \(3,\)"),
        (lambda m, x: m.group_topk_mask(x(8), 4, torch.tensor([1, 5])), r"0 <= k_g <= group_size=4, got k_g=5"),
        (lambda m, x: m.group_topk_mask(x(8), 4, torch.tensor([-1, 2])), r"got k_g=-1"),
        (lambda m, x: m.group_topk_mask(x(8), 4, torch.tensor([1.0, 2.0])), r"integer tensor, got a tensor of dtype torch.float32"),
        (lambda m, x: m.group_topk_mask(x(8).reshape(2, 2, 2), 4, 2), r"scores must be 1-D \(N,\) or 2-D \(num_groups, G\), got shape \(2, 2, 2\)"),
        (lambda m, x: m.group_topk_mask(x(8).reshape(2, 4), 2, 1), r"scores has shape \(2, 4\) but group_size=2"),
        (lambda m, x: m.group_topk_mask(x(8), 0, 1), r"group_size must be a positive int, got group_size=0"),
        (lambda m, x: m.group_topk_mask(x(8).to(torch.complex64), 4, 1), r"scores must have a real dtype"),
        (lambda m, x: m.group_advantages(x(8), 4, keep=torch.ones(4, dtype=torch.bool)), r"keep must have the shape of rewards \(8,\), got \(4,\)"),
        (lambda m, x: m.group_advantages(x(8), 4, scale="std"), r"scale must be one of \('group', 'batch', 'none'\), got scale='std'"),
        (lambda m, x: m.group_advantages(x(8), 4, eps=-1.0), r"eps must be a finite float > 0, got eps=-1.0"),
        (lambda m, x: m.group_advantages(x(8), 4, eps=0), r"eps must be a finite float > 0, got eps=0"),
        (lambda m, x: m.group_advantages(x(8), 4, keep=x(8) > 0), None),  # a bool mask is fine
        (lambda m, x: m.group_advantages(x(8), 4, keep=torch.ones(8)), r"keep must be a bool tensor, got dtype torch.float32"),
        (lambda m, x: m.group_topk_mask(x(8), 4, 2, largest="no"), r"largest must be a bool, got largest='no'"),
        (lambda m, x: m.gfpo_filter_advantages(x(8), x(8), 4, 2, largest=1), r"largest must be a bool, got largest=1"),
        (lambda m, x: m.group_advantages(x(9), 4), r"rewards has N=9 rows"),
        (lambda m, x: m.group_topk_mask(x(8), 4, torch.tensor([1, 5], dtype=torch.uint64)),
         r"0 <= k_g <= group_size=4, got k_g=5"),
        (lambda m, x: m.group_topk_mask(x(8), 4, torch.tensor([1, 2], dtype=torch.uint64)), None),
        (lambda m, x: m.gfpo_filter_advantages(x(8), x(12), 4, 2), r"scores must have the shape of rewards \(8,\), got \(12,\)"),
        (lambda m, x: m.gfpo_filter_advantages(x(8), x(8), 4, 9), r"got k=9"),
    ],
)
def test_bad_input_raises_value_error(impl, call, match):
    x = lambda n: torch.randn(n, device=DEVICE)  # noqa: E731
    if match is None:
        call(_ops(impl), x)  # the valid neighbour of a refused input
        return
    with pytest.raises(ValueError, match=match):
        call(_ops(impl), x)


@pytest.mark.parametrize("impl", IMPLS)
def test_non_tensor_input_raises_type_error(impl):
    with pytest.raises(TypeError, match="scores must be a torch.Tensor, got list"):
        _ops(impl).group_topk_mask([1.0, 2.0], 2, 1)


def test_forced_backend_that_cannot_run_raises():
    with gfpo_kernels.use_backend("triton"), pytest.raises(RuntimeError, match="backend 'triton' was forced"):
        gfpo_kernels.group_topk_mask(torch.randn(8192 * 2, device=DEVICE), 8192, 1)
    with pytest.raises(ValueError, match="backend must be one of"):
        with gfpo_kernels.use_backend("cuda"):
            pass


def test_misspelt_backend_in_the_environment_raises(monkeypatch):
    monkeypatch.setenv("GFPO_KERNELS_BACKEND", "cudaa")
    with pytest.raises(ValueError, match=r"GFPO_KERNELS_BACKEND must be one of .*, got 'cudaa'"):
        gfpo_kernels.group_topk_mask(torch.randn(8, device=DEVICE), 4, 2)
    monkeypatch.setenv("GFPO_KERNELS_BACKEND", "reference")
    assert gfpo_kernels.group_topk_mask(torch.arange(8.0, device=DEVICE), 4, 2).tolist() == [False, False, True, True] * 2


@pytest.mark.parametrize("module", ["gfpo_kernels._validation", "gfpo_trainer._names"])
def test_closest_name_is_difflibs_closest_above_its_cutoff(module):
    """The one rule of every did-you-mean hint (gfpo_kernels._validation, and gfpo_trainer._names for what is checked
    before torch is imported): difflib's similarity ratio 2M/T >= 0.6."""
    import importlib

    closest_name, did_you_mean = (getattr(importlib.import_module(module), name)
                                  for name in ("closest_name", "did_you_mean"))

    assert closest_name("lenght", ("length", "token_efficiency")) == "length"  # ratio 2*5/12 = 0.83
    assert closest_name("grpoo", ("group", "dr_grpo", "grpo")) == "grpo"  # 0.89, against 0.6 and 0.67
    assert closest_name("ppo", ("grpo", "sapo")) is None  # "po" in common: 2*2/7 = 0.57
    assert closest_name(3, ("length",)) is None
    assert did_you_mean("tok", ("token", "sequence")) == " (did you mean 'token'?)"  # 2*3/8 = 0.75
    assert did_you_mean("shortest", ("length", "token_efficiency")) == ""


@pytest.mark.parametrize("call, message", [
    (lambda: gfpo_kernels.group_advantages(torch.zeros(8), 4, scale="grop"),
     "scale must be one of ('group', 'batch', 'none'), got scale='grop' (did you mean 'group'?)"),
    (lambda: gfpo_kernels.fused_linear_grpo_loss(*_linear_inputs(), loss_type="dapoo"),
     "loss_type must be one of ('grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo'), got "
     "loss_type='dapoo' (did you mean 'dapo'?)"),
    (lambda: gfpo_kernels.fused_linear_grpo_loss(*_linear_inputs(), importance_sampling_level="tok"),
     "importance_sampling_level must be one of ('token', 'sequence'), got importance_sampling_level='tok' (did you "
     "mean 'token'?)"),
    (lambda: gfpo_kernels.fused_linear_grpo_loss(*_linear_inputs(), loss_type="made_up"),  # nothing close: no hint
     "loss_type must be one of ('grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo'), got "
     "loss_type='made_up'"),
    (lambda: gfpo_kernels.use_backend("trition").__enter__(),
     "backend must be one of ('triton', 'cpp', 'torch', 'reference') or None, got 'trition' (did you mean 'triton'?)"),
])
def test_unknown_names_get_the_closest_choice(call, message):
    with pytest.raises(ValueError) as error:
        call()
    assert str(error.value) == message


def _linear_inputs():
    """hidden (1, 2, 4), weight (5, 4), target_ids, mask (1, 2), advantages (1,): a valid call but for the option."""
    return torch.zeros(1, 2, 4), torch.zeros(5, 4), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.ones(1)


def test_misspelt_backend_in_the_environment_gets_the_closest_choice(monkeypatch):
    monkeypatch.setenv("GFPO_KERNELS_BACKEND", "refrence")
    with pytest.raises(ValueError) as error:
        gfpo_kernels.group_topk_mask(torch.randn(8, device=DEVICE), 4, 2)
    assert str(error.value) == ("GFPO_KERNELS_BACKEND must be one of ('triton', 'cpp', 'torch', 'reference') (or "
                                "unset), got 'refrence' (did you mean 'reference'?)")


def test_errors_from_the_cpp_ops_name_the_argument():
    """The custom ops check their own input too (they are callable directly, e.g. from torch.compile). Their
    std::invalid_argument reaches Python as ValueError up to torch 2.14 and as RuntimeError from 2.15 on (run under
    2.10, 2.11, 2.13, 2.14.1 and 2.15.0): through the stable ABI a kernel cannot pick the Python exception type. The
    public functions check their input in Python first and raise ValueError on every torch."""
    if "cpp" not in gfpo_kernels.available_backends("group", "cpu"):
        pytest.skip("extension not built")
    error = ValueError if tuple(map(int, torch.__version__.split(".")[:2])) < (2, 15) else RuntimeError
    with pytest.raises(error, match="scale must be 'group', 'batch' or 'none', got 'std'"):
        torch.ops.gfpo.group_advantages(torch.randn(2, 4), None, "std", 1e-4)
    with pytest.raises(error, match="k must have num_groups=2 entries"):
        torch.ops.gfpo.group_topk_mask(torch.randn(2, 4), torch.tensor([1, 2, 3]), 0, True)
