// Shared declarations of the gfpo group ops (segmented top-k + masked mean/std advantages).
//
// Every op takes 2-D (num_groups, G) contiguous tensors; the Python wrapper in gfpo_kernels validates input,
// reshapes flat TRL-layout tensors; k is an int64 tensor of length num_groups (adaptive k) or one int for every
// group (k_fixed: no tensor to fill, so the CUDA op is one launch).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace gfpo {

enum class Scale { kGroup = 0, kBatch = 1, kNone = 2 };

Scale parse_scale(c10::string_view scale);

// What a device kernel computes for every group in one pass.
//   keep:     bool (num_groups, G); the top-k mask (or the given keep mask, or all true).
//   adv:      (num_groups, G); (r - mean_g) / (std_g + eps) for Scale::kGroup, r - mean_g otherwise;
//             0 for rows not kept and rows whose reward is not finite (NaN, +-inf). float32, but double for
//             Scale::kBatch, whose centred rewards are divided by the batch std before the one rounding to float32.
//   n, mean, m2: per-group count of kept finite rewards, their mean and sum of squared deviations
//             (only filled for Scale::kBatch, where the host combines them into one batch std).
struct GroupResult {
  at::Tensor keep;
  at::Tensor adv;
  at::Tensor n;
  at::Tensor mean;
  at::Tensor m2;
};

// The device kernels. `scores`, `k`, `keep_in`, `rewards` may be undefined tensors:
//   scores defined -> the top-k mask of scores with k (int64 per group; undefined: k_fixed for every group)
//   decides which rows are kept;
//   else keep_in defined -> that mask; else every row is kept.
//   rewards undefined -> only the mask is computed.
GroupResult group_filter_advantages_cpu(const at::Tensor& rewards, const at::Tensor& scores, const at::Tensor& k,
                                        int64_t k_fixed, const at::Tensor& keep_in, bool largest, Scale scale,
                                        double eps);
#ifdef GFPO_WITH_CUDA
GroupResult group_filter_advantages_cuda(const at::Tensor& rewards, const at::Tensor& scores, const at::Tensor& k,
                                         int64_t k_fixed, const at::Tensor& keep_in, bool largest, Scale scale,
                                         double eps);
#endif

// The dtype a kernel reads rewards in: float32 where that is exact (float32, the common case, is not copied;
// fp16, bf16 and small integers), double otherwise (float64, int32, int64), so every backend sees the values the
// float64 reference sees.
at::ScalarType reward_read_type(at::ScalarType type);

// Scale::kBatch: divides the centred advantages by the unbiased std of all kept finite rewards (+ eps),
// combining the per-group (n, mean, m2) with Chan's formula. Shared by every device.
at::Tensor apply_batch_scale(const GroupResult& result, double eps);

}  // namespace gfpo
