// CUDA kernel of the gfpo group ops: one warp per group.
//
// The warp stages its group's scores in shared memory; each lane ranks its rows by counting the rows that
// rank before them (better score, NaN last, ties -> lower index), which is exact for every dtype and cheap
// for G <= 1024 (the ranks of a group cost G^2/32 comparisons per lane). Rewards are read in float32 or double
// (reward_read_type); count, mean and sum of squared deviations use butterfly reductions in double (rewards up to
// FLT_MAX square without overflow, float64 rewards keep their digits), so the result does not depend on the launch.
#include <ATen/OpMathType.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "group_ops.h"

namespace gfpo {

void register_cuda_impls(torch::Library& m);

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxGroupSize = 1024;

__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ double warp_max(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Rewards are float32 or double (a warp-uniform branch: one kernel per score dtype, not two).
__device__ __forceinline__ double reward_at(const void* rewards, bool rewards_double, int64_t i) {
  return rewards_double ? static_cast<const double*>(rewards)[i]
                        : static_cast<double>(static_cast<const float*>(rewards)[i]);
}

template <typename scalar_t>
__global__ void group_filter_advantages_kernel(const scalar_t* __restrict__ scores, const int64_t* __restrict__ k,
                                               int64_t k_fixed,
                                               const bool* __restrict__ keep_in, const void* __restrict__ rewards,
                                               bool rewards_double, int64_t num_groups, int G, bool largest,
                                               bool divide_by_std, double eps, bool* __restrict__ keep_out,
                                               void* __restrict__ adv, bool adv_double, double* __restrict__ n_out,
                                               double* __restrict__ mean_out, double* __restrict__ m2_out) {
  using opmath_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (g >= num_groups) return;  // warp-uniform: only __syncwarp is used below
  opmath_t* vals = reinterpret_cast<opmath_t*>(smem) + warp * G;
  bool* kept = reinterpret_cast<bool*>(reinterpret_cast<opmath_t*>(smem) + kWarpsPerBlock * G) + warp * G;
  const int64_t base = g * G;

  if (scores != nullptr) {
    for (int i = lane; i < G; i += 32) vals[i] = static_cast<opmath_t>(scores[base + i]);
    __syncwarp();
    const int64_t kg = k != nullptr ? k[g] : k_fixed;
    for (int i = lane; i < G; i += 32) {
      const opmath_t vi = vals[i];
      const bool ni = vi != vi;
      int rank = 0;
      for (int j = 0; j < G; ++j) {
        const opmath_t vj = vals[j];
        const bool nj = vj != vj;
        const bool before = ni != nj ? ni : (!ni && vi != vj ? (largest ? vj > vi : vj < vi) : j < i);
        rank += before;
      }
      kept[i] = rank < kg;
    }
  } else {
    for (int i = lane; i < G; i += 32) kept[i] = keep_in == nullptr || keep_in[base + i];
  }
  __syncwarp();
  if (keep_out != nullptr) {
    for (int i = lane; i < G; i += 32) keep_out[base + i] = kept[i];
  }
  if (rewards == nullptr) return;

  // Mean of shifted data: a group of equal rewards gets a mean equal to them, so exactly 0 advantages.
  double n = 0.0, shift = -INFINITY;
  for (int i = lane; i < G; i += 32) {
    const double r = reward_at(rewards, rewards_double, base + i);
    if (kept[i] && isfinite(r)) {
      n += 1.0;
      shift = fmax(shift, r);
    }
  }
  n = warp_sum(n);
  shift = n > 0.0 ? warp_max(shift) : 0.0;
  double sum = 0.0;
  for (int i = lane; i < G; i += 32) {
    const double r = reward_at(rewards, rewards_double, base + i);
    if (kept[i] && isfinite(r)) sum += r - shift;
  }
  sum = warp_sum(sum);
  const double mean = n > 0.0 ? shift + sum / n : 0.0;
  double m2 = 0.0;
  for (int i = lane; i < G; i += 32) {
    const double r = reward_at(rewards, rewards_double, base + i);
    if (kept[i] && isfinite(r)) m2 += (r - mean) * (r - mean);
  }
  m2 = warp_sum(m2);
  const double std_g = n >= 2.0 ? sqrt(m2 / (n - 1.0)) : 0.0;
  const double denom = divide_by_std ? std_g + eps : 1.0;
  for (int i = lane; i < G; i += 32) {
    const double r = reward_at(rewards, rewards_double, base + i);
    const double a = kept[i] && isfinite(r) ? (r - mean) / denom : 0.0;
    if (adv_double) {
      static_cast<double*>(adv)[base + i] = a;
    } else {
      static_cast<float*>(adv)[base + i] = static_cast<float>(a);
    }
  }
  if (n_out != nullptr && lane == 0) {
    n_out[g] = n;
    mean_out[g] = mean;
    m2_out[g] = m2;
  }
}

}  // namespace

GroupResult group_filter_advantages_cuda(const at::Tensor& rewards, const at::Tensor& scores, const at::Tensor& k,
                                         int64_t k_fixed, const at::Tensor& keep_in, bool largest, Scale scale,
                                         double eps) {
  const at::Tensor& shape_src = rewards.defined() ? rewards : scores;
  const c10::cuda::CUDAGuard guard(shape_src.device());
  const int64_t num_groups = shape_src.size(0), G = shape_src.size(1);
  TORCH_CHECK_VALUE(G <= kMaxGroupSize, "the CUDA group kernel supports group_size <= ", kMaxGroupSize, ", got ", G);
  GroupResult out;
  out.keep = at::empty({num_groups, G}, shape_src.options().dtype(at::kBool));
  const at::Tensor s = scores.defined() ? scores.contiguous() : at::Tensor();
  const at::Tensor kk = scores.defined() && k.defined() ? k.to(at::kLong).contiguous() : at::Tensor();
  const at::Tensor keep_c = keep_in.defined() ? keep_in.to(at::kBool).contiguous() : at::Tensor();
  const at::Tensor r =
      rewards.defined() ? rewards.to(reward_read_type(rewards.scalar_type())).contiguous() : at::Tensor();
  const bool rewards_double = r.defined() && r.scalar_type() == at::kDouble;
  const bool batch = rewards.defined() && scale == Scale::kBatch;
  // Scale::kBatch: centred rewards in double until the batch std divides them (see GroupResult)
  if (rewards.defined()) {
    out.adv = at::empty({num_groups, G}, shape_src.options().dtype(batch ? at::kDouble : at::kFloat));
  }
  if (batch) {
    const auto dopts = shape_src.options().dtype(at::kDouble);
    out.n = at::empty({num_groups}, dopts);
    out.mean = at::empty({num_groups}, dopts);
    out.m2 = at::empty({num_groups}, dopts);
  }
  if (num_groups == 0) return out;

  const at::ScalarType score_type = s.defined() ? s.scalar_type() : at::kFloat;
  const dim3 block(32 * kWarpsPerBlock);
  const dim3 grid(static_cast<unsigned>((num_groups + kWarpsPerBlock - 1) / kWarpsPerBlock));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_ALL_TYPES_AND2(at::kHalf, at::kBFloat16, score_type, "gfpo_group_filter_advantages_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const size_t smem = static_cast<size_t>(kWarpsPerBlock) * G * (sizeof(opmath_t) + sizeof(bool));
    group_filter_advantages_kernel<scalar_t><<<grid, block, smem, stream>>>(
        s.defined() ? s.data_ptr<scalar_t>() : nullptr, kk.defined() ? kk.data_ptr<int64_t>() : nullptr, k_fixed,
        keep_c.defined() ? keep_c.data_ptr<bool>() : nullptr, r.defined() ? r.const_data_ptr() : nullptr,
        rewards_double, num_groups, static_cast<int>(G), largest, scale == Scale::kGroup, eps,
        out.keep.data_ptr<bool>(), r.defined() ? out.adv.data_ptr() : nullptr, batch,
        batch ? out.n.data_ptr<double>() : nullptr, batch ? out.mean.data_ptr<double>() : nullptr,
        batch ? out.m2.data_ptr<double>() : nullptr);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace gfpo

TORCH_LIBRARY_IMPL(gfpo, CUDA, m) { gfpo::register_cuda_impls(m); }
