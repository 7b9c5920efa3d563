// Shared declarations of the gfpo group ops (segmented top-k + masked mean/std advantages).
//
// Built on the LibTorch stable ABI only (torch/csrc/stable, torch/headeronly and the C shim; setup.py compiles
// with TORCH_TARGET_VERSION = 2.10), so one binary loads in every torch from 2.10 on; tests/test_extension_abi.py
// checks that _C.so needs no other libtorch symbol.
//
// Every op takes 2-D (num_groups, G) contiguous tensors; the Python wrapper in gfpo_kernels validates input,
// reshapes flat TRL-layout tensors; k is an int64 tensor of length num_groups (adaptive k) or one int for every
// group (k_fixed: no tensor to fill, so the CUDA op is one launch).
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

// Bad input: std::invalid_argument, which torch's Python bindings raise as ValueError (as TORCH_CHECK_VALUE did);
// the message is the arguments streamed together.
#define GFPO_CHECK_VALUE(cond, ...)                                       \
  do {                                                                    \
    if (!(cond)) throw std::invalid_argument(::gfpo::concat(__VA_ARGS__)); \
  } while (0)

namespace gfpo {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// "[2, 4]": a shape as torch prints it, for error messages.
std::string shape_str(const Tensor& t);

enum class Scale { kGroup = 0, kBatch = 1, kNone = 2 };

Scale parse_scale(std::string_view scale);

// An undefined tensor: the "none" of the kernels' optional arguments.
Tensor undefined();

// A new contiguous tensor of `sizes` and `dtype` on the device of `like` (the shim's empty_strided: no boxed
// dispatcher call, which costs microseconds on the small CPU batches).
Tensor empty(std::initializer_list<int64_t> sizes, ScalarType dtype, const Tensor& like);

// `t` as a contiguous tensor of `dtype` (itself when it already is one).
Tensor contiguous_as(const Tensor& t, ScalarType dtype);

// What a device kernel returns: keep, bool (num_groups, G), the top-k mask (or the given keep mask, or all true);
// adv, float32 (num_groups, G), undefined when no rewards were given.
struct GroupResult {
  Tensor keep;
  Tensor adv;
};

// The device kernels. `scores`, `k`, `keep_in`, `rewards` may be undefined tensors:
//   scores defined -> the top-k mask of scores with k (int64 per group; undefined: k_fixed for every group)
//   decides which rows are kept;
//   else keep_in defined -> that mask; else every row is kept.
//   rewards undefined -> only the mask is computed.
// adv: (r - mean_g) / (std_g + eps) for Scale::kGroup, r - mean_g for kNone, and for kBatch r - mean_g divided by
// the unbiased std of all kept finite rewards of the batch (+ eps), the per-group (n, mean, m2) combined with
// Chan's formula and the centred rewards kept in double until that one division. 0 for rows not kept and rows
// whose reward is not finite (NaN, +-inf). Statistics accumulate in double.
GroupResult group_filter_advantages_cpu(const Tensor& rewards, const Tensor& scores, const Tensor& k, int64_t k_fixed,
                                        const Tensor& keep_in, bool largest, Scale scale, double eps);
#ifdef GFPO_WITH_CUDA
GroupResult group_filter_advantages_cuda(const Tensor& rewards, const Tensor& scores, const Tensor& k,
                                         int64_t k_fixed, const Tensor& keep_in, bool largest, Scale scale,
                                         double eps);
#endif

// The dtype a kernel reads rewards in: float32 where that is exact (float32, the common case, is not copied;
// fp16, bf16 and small integers), double otherwise (float64, int32, int64), so every backend sees the values the
// float64 reference sees.
ScalarType reward_read_type(ScalarType type);

// Calls f(T{}) with T the C++ type of the score dtype `type`: the real dtypes the kernels rank (the Python wrapper
// turns bool, float8 and the unsigned types into one of these).
template <typename F>
void dispatch_score_type(ScalarType type, const F& f) {
  switch (type) {
    case ScalarType::Byte: return f(uint8_t{});
    case ScalarType::Char: return f(int8_t{});
    case ScalarType::Short: return f(int16_t{});
    case ScalarType::Int: return f(int32_t{});
    case ScalarType::Long: return f(int64_t{});
    case ScalarType::Half: return f(c10::Half{});
    case ScalarType::BFloat16: return f(c10::BFloat16{});
    case ScalarType::Float: return f(float{});
    case ScalarType::Double: return f(double{});
    default: GFPO_CHECK_VALUE(false, "scores must have a real dtype, got ", type);
  }
}

}  // namespace gfpo
