// CUDA kernel of the gfpo group ops: one warp per group.
//
// The warp stages its group's scores in shared memory; each lane ranks its rows by counting the rows that
// rank before them (better score, NaN last, ties -> lower index), which is exact for every dtype and cheap
// for G <= 1024 (the ranks of a group cost G^2/32 comparisons per lane). Rewards are read in float32 or double
// (reward_read_type); count, mean and sum of squared deviations use butterfly reductions in double (rewards up to
// FLT_MAX square without overflow, float64 rewards keep their digits), so the result does not depend on the launch.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include "group_ops.h"

namespace gfpo {

namespace {

// Half and BFloat16 scores are compared in float (exact: every half and bfloat16 value is a float).
template <typename T>
using opmath = std::conditional_t<std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>, float, T>;

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
  using opmath_t = opmath<scalar_t>;
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

// Scale::kBatch, on one block of kBatchThreads: the batch's unbiased std from the per-group count, mean and sum of
// squared deviations (the CPU's Chan formula, its sums reduced in a fixed tree, so the result does not depend on
// the launch), then denom = std + eps for batch_scale_kernel.
constexpr int kBatchThreads = 1024;

__device__ double block_sum(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kBatchThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) shared[threadIdx.x] += shared[threadIdx.x + stride];
    __syncthreads();
  }
  const double total = shared[0];
  __syncthreads();
  return total;
}

__global__ void batch_denominator_kernel(const double* __restrict__ n, const double* __restrict__ mean,
                                         const double* __restrict__ m2, int64_t num_groups, double eps,
                                         double* __restrict__ denom) {
  __shared__ double shared[kBatchThreads];
  double total = 0.0, weighted = 0.0;
  for (int64_t g = threadIdx.x; g < num_groups; g += kBatchThreads) {
    total += n[g];
    weighted += n[g] * mean[g];
  }
  total = block_sum(total, shared);
  const double batch_mean = block_sum(weighted, shared) / fmax(total, 1.0);
  double batch_m2 = 0.0;
  for (int64_t g = threadIdx.x; g < num_groups; g += kBatchThreads) {
    batch_m2 += m2[g] + n[g] * (mean[g] - batch_mean) * (mean[g] - batch_mean);
  }
  batch_m2 = block_sum(batch_m2, shared);
  if (threadIdx.x == 0) *denom = (total >= 2.0 ? sqrt(batch_m2 / (total - 1.0)) : 0.0) + eps;
}

__global__ void batch_scale_kernel(const double* __restrict__ centred, const double* __restrict__ denom, int64_t size,
                                   float* __restrict__ adv) {
  const double d = *denom;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < size;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    adv[i] = static_cast<float>(centred[i] / d);
  }
}

// The current CUDA stream of `device_index`, from the stable C shim's aoti_torch_get_current_cuda_stream. That
// function lives in libtorch_cuda.so, which a CPU-only torch does not have; _C.so must load there too (its CPU
// kernels), so the function is looked up here, when the first CUDA tensor arrives (only a CUDA torch makes one),
// instead of being a symbol the loader must resolve.
cudaStream_t current_stream(int32_t device_index) {
  using StreamGetter = AOTITorchError (*)(int32_t, void**);
  static const StreamGetter getter = []() -> StreamGetter {
    void* torch_cuda = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    return torch_cuda ? reinterpret_cast<StreamGetter>(dlsym(torch_cuda, "aoti_torch_get_current_cuda_stream"))
                      : nullptr;
  }();
  if (getter == nullptr) throw std::runtime_error("gfpo_kernels._C: libtorch_cuda.so is not loaded (a CPU torch?)");
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(getter(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

void check_launch() {
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) throw std::runtime_error(concat("gfpo_kernels._C: CUDA error: ", cudaGetErrorString(error)));
}

}  // namespace

GroupResult group_filter_advantages_cuda(const Tensor& rewards, const Tensor& scores, const Tensor& k,
                                         int64_t k_fixed, const Tensor& keep_in, bool largest, Scale scale,
                                         double eps) {
  const Tensor& shape_src = rewards.defined() ? rewards : scores;
  const int32_t device = shape_src.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const int64_t num_groups = shape_src.size(0), G = shape_src.size(1);
  GFPO_CHECK_VALUE(G <= kMaxGroupSize, "the CUDA group kernel supports group_size <= ", kMaxGroupSize, ", got ", G);
  GroupResult out;
  out.keep = empty({num_groups, G}, ScalarType::Bool, shape_src);
  const Tensor s = scores.defined() ? contiguous_as(scores, scores.scalar_type()) : undefined();
  const Tensor kk = scores.defined() && k.defined() ? contiguous_as(k, ScalarType::Long) : undefined();
  const Tensor keep_c = keep_in.defined() ? contiguous_as(keep_in, ScalarType::Bool) : undefined();
  const Tensor r = rewards.defined() ? contiguous_as(rewards, reward_read_type(rewards.scalar_type())) : undefined();
  const bool rewards_double = r.defined() && r.scalar_type() == ScalarType::Double;
  const bool batch = rewards.defined() && scale == Scale::kBatch;
  if (rewards.defined()) out.adv = empty({num_groups, G}, ScalarType::Float, shape_src);
  // Scale::kBatch: the centred rewards wait for the batch std in double (see group_filter_advantages_cpu); one
  // buffer holds them, then the per-group n, mean, m2, then the denominator.
  Tensor batch_buffer = batch ? empty({num_groups * G + 3 * num_groups + 1}, ScalarType::Double, shape_src) : undefined();
  double* const centred = batch ? batch_buffer.mutable_data_ptr<double>() : nullptr;
  double* const stats = batch ? centred + num_groups * G : nullptr;
  if (num_groups == 0) return out;

  const dim3 block(32 * kWarpsPerBlock);
  const dim3 grid(static_cast<unsigned>((num_groups + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const cudaStream_t stream = current_stream(device);
  dispatch_score_type(s.defined() ? s.scalar_type() : ScalarType::Float, [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    const size_t smem = static_cast<size_t>(kWarpsPerBlock) * G * (sizeof(opmath<scalar_t>) + sizeof(bool));
    group_filter_advantages_kernel<scalar_t><<<grid, block, smem, stream>>>(
        s.defined() ? static_cast<const scalar_t*>(s.const_data_ptr()) : nullptr,
        kk.defined() ? kk.const_data_ptr<int64_t>() : nullptr, k_fixed,
        keep_c.defined() ? keep_c.const_data_ptr<bool>() : nullptr, r.defined() ? r.const_data_ptr() : nullptr,
        rewards_double, num_groups, static_cast<int>(G), largest, scale == Scale::kGroup, eps,
        out.keep.mutable_data_ptr<bool>(),
        r.defined() ? (batch ? static_cast<void*>(centred) : out.adv.mutable_data_ptr()) : nullptr, batch,
        stats, batch ? stats + num_groups : nullptr, batch ? stats + 2 * num_groups : nullptr);
  });
  check_launch();
  if (batch) {
    double* const denom = stats + 3 * num_groups;
    batch_denominator_kernel<<<1, kBatchThreads, 0, stream>>>(stats, stats + num_groups, stats + 2 * num_groups,
                                                              num_groups, eps, denom);
    check_launch();
    const int64_t size = num_groups * G;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((size + 255) / 256, 4096));
    batch_scale_kernel<<<blocks, 256, 0, stream>>>(centred, denom, size, out.adv.mutable_data_ptr<float>());
    check_launch();
  }
  return out;
}

}  // namespace gfpo
