// CPU kernels of the gfpo group ops, the op schemas and their registration, and the Python module stub of
// gfpo_kernels._C. Only the LibTorch stable ABI is used (see group_ops.h).
//
// torch::stable::parallel_for (at::parallel_for behind the stable C shim) splits the groups over threads; each
// thread ranks, filters and normalises kLanes groups at a time: ranks by counting for G <= 32, by
// std::nth_element (O(G)) above. Statistics accumulate in double.
#include <Python.h>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "group_ops.h"

namespace gfpo {

ScalarType reward_read_type(ScalarType type) {
  return type == ScalarType::Double || type == ScalarType::Int || type == ScalarType::Long ? ScalarType::Double
                                                                                          : ScalarType::Float;
}

Scale parse_scale(std::string_view scale) {
  if (scale == "group") return Scale::kGroup;
  if (scale == "batch") return Scale::kBatch;
  if (scale == "none") return Scale::kNone;
  throw std::invalid_argument(concat("scale must be 'group', 'batch' or 'none', got '", scale, "'"));
}

std::string shape_str(const Tensor& t) {
  std::ostringstream out;
  out << '[';
  const auto sizes = t.sizes();
  for (size_t i = 0; i < sizes.size(); ++i) out << (i > 0 ? ", " : "") << sizes[i];
  out << ']';
  return out.str();
}

Tensor undefined() { return Tensor(); }

Tensor empty(std::initializer_list<int64_t> sizes, ScalarType dtype, const Tensor& like) {
  int32_t code;
  switch (dtype) {
    case ScalarType::Bool: code = aoti_torch_dtype_bool(); break;
    case ScalarType::Float: code = aoti_torch_dtype_float32(); break;
    case ScalarType::Double: code = aoti_torch_dtype_float64(); break;
    default: throw std::logic_error(concat("gfpo: empty() of dtype ", dtype));
  }
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (size_t i = sizes.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<int64_t>(sizes.begin()[i], 1);
  }
  int32_t device_type, device_index;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(like.get(), &device_index));
  AtenTensorHandle out;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.begin(), strides.data(),
                                                  code, device_type, device_index, &out));
  return Tensor(out);
}

Tensor contiguous_as(const Tensor& t, ScalarType dtype) {
  if (t.scalar_type() == dtype && t.is_contiguous()) return t;
  return torch::stable::contiguous(torch::stable::to(t, dtype));
}

namespace {

// Scores become integer order keys whose order is the rank order (smaller ranks first), so ranking is one
// integer comparison (key, then index). Scores of up to 4 bytes get int32 keys (exact, and SIMD-friendly
// even on baseline x86-64); double and int64 scores get int64 keys.
template <typename scalar_t>
using key_type = std::conditional_t<(sizeof(scalar_t) <= 4), int32_t, int64_t>;

// Floats map through their IEEE bits (-0.0 folded into 0.0), NaN to the largest key (last whatever
// `largest`), and `largest` flips the order by bitwise not (no overflow). Finite floats never reach the
// NaN key; integer scores have no NaN.
template <typename scalar_t>
inline key_type<scalar_t> order_key(scalar_t v, bool largest) {
  using key_t = key_type<scalar_t>;
  using float_t = std::conditional_t<std::is_same_v<key_t, int32_t>, float, double>;
  key_t key;
  if constexpr (std::is_integral_v<scalar_t>) {
    key = static_cast<key_t>(v);
  } else {
    float_t f = static_cast<float_t>(v);
    if (std::isnan(f)) return std::numeric_limits<key_t>::max();
    if (f == 0) f = 0;
    key_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    key = bits >= 0 ? bits : bits ^ std::numeric_limits<key_t>::max();
  }
  return largest ? ~key : key;
}

// Groups are processed kLanes at a time with their data transposed ([row][lane]), so the innermost loops
// run over independent groups: SIMD-friendly, and no long dependency chains (a single group of 16 rows is
// too short to vectorise and latency-bound in its reductions).
constexpr int64_t kLanes = 8;
constexpr int64_t kMaxCountingGroupSize = 32;

// Ranks by counting, for every row, the rows of its group ranked before it (smaller key, or equal key at a
// lower index); key[i * kLanes + b] is row i of lane b. keep is row-major: keep[b * G + i].
template <typename key_t>
void topk_by_counting(const key_t* key, int64_t G, int64_t lanes, const int64_t* k, bool* keep) {
  for (int64_t i = 0; i < G; ++i) {
    const key_t* ki = key + i * kLanes;
    int32_t rank[kLanes] = {};
    for (int64_t j = 0; j < i; ++j) {
      for (int64_t b = 0; b < kLanes; ++b) rank[b] += key[j * kLanes + b] <= ki[b];
    }
    for (int64_t j = i + 1; j < G; ++j) {
      for (int64_t b = 0; b < kLanes; ++b) rank[b] += key[j * kLanes + b] < ki[b];
    }
    for (int64_t b = 0; b < lanes; ++b) keep[b * G + i] = rank[b] < k[b];
  }
}

// One larger group by selection, O(G): keep[i] = row i is among the k smallest (key, index).
template <typename key_t>
void topk_by_selection(const key_t* key, int64_t G, int64_t k, int64_t* order, bool* keep) {
  std::fill(keep, keep + G, false);
  k = std::min(k, G);
  if (k <= 0) return;
  std::iota(order, order + G, int64_t{0});
  auto before = [key](int64_t a, int64_t b) { return key[a] < key[b] || (key[a] == key[b] && a < b); };
  if (k < G) std::nth_element(order, order + (k - 1), order + G, before);
  for (int64_t i = 0; i < k; ++i) keep[order[i]] = true;
}

// ok ? a : b through bit masks: compilers turn a data-dependent ?: into a branch, and which rows are kept is
// random, so that branch would be mispredicted half the time.
inline double select(bool ok, double a, double b) {
  uint64_t ua, ub;
  std::memcpy(&ua, &a, sizeof(ua));
  std::memcpy(&ub, &b, sizeof(ub));
  const uint64_t mask = uint64_t{0} - static_cast<uint64_t>(ok);
  const uint64_t u = (ua & mask) | (ub & ~mask);
  double out;
  std::memcpy(&out, &u, sizeof(out));
  return out;
}

// Per-lane count, mean and sum of squared deviations of the kept, finite rewards, in double, then the
// advantages. The mean is taken of data shifted by the lane's largest reward, so a group of equal rewards
// gets exactly 0. x and w are [row][lane] scratch.
template <typename reward_t, typename adv_t>
void advantages_lanes(const reward_t* r, const bool* keep, int64_t G, int64_t lanes, Scale scale, double eps, double* x,
                      double* w, adv_t* adv, double* n_out, double* mean_out, double* m2_out) {
  double n[kLanes] = {}, shift[kLanes], sum[kLanes] = {}, mean[kLanes], m2[kLanes] = {}, inv[kLanes];
  std::fill(shift, shift + kLanes, -INFINITY);
  for (int64_t i = 0; i < G; ++i) {
    for (int64_t b = 0; b < kLanes; ++b) {
      double xi = 0.0;
      bool ok = false;
      if (b < lanes) {  // predictable: false only in the last block
        xi = r[b * G + i];
        ok = keep[b * G + i] & (std::abs(xi) <= std::numeric_limits<double>::max());  // not NaN nor +-inf
      }
      x[i * kLanes + b] = select(ok, xi, 0.0);
      w[i * kLanes + b] = static_cast<double>(ok);
      n[b] += static_cast<double>(ok);
      shift[b] = std::max(shift[b], select(ok, xi, -INFINITY));
    }
  }
  for (int64_t b = 0; b < kLanes; ++b) shift[b] = n[b] > 0.0 ? shift[b] : 0.0;
  for (int64_t i = 0; i < G; ++i) {
    for (int64_t b = 0; b < kLanes; ++b) sum[b] += w[i * kLanes + b] * (x[i * kLanes + b] - shift[b]);
  }
  for (int64_t b = 0; b < kLanes; ++b) mean[b] = shift[b] + sum[b] / std::max(n[b], 1.0);
  for (int64_t i = 0; i < G; ++i) {
    for (int64_t b = 0; b < kLanes; ++b) {
      const double d = x[i * kLanes + b] - mean[b];
      m2[b] += w[i * kLanes + b] * d * d;
    }
  }
  for (int64_t b = 0; b < kLanes; ++b) {
    const double std_g = n[b] >= 2.0 ? std::sqrt(m2[b] / (n[b] - 1.0)) : 0.0;
    inv[b] = 1.0 / (scale == Scale::kGroup ? std_g + eps : 1.0);
  }
  for (int64_t b = 0; b < lanes; ++b) {
    for (int64_t i = 0; i < G; ++i) {
      adv[b * G + i] = static_cast<adv_t>(w[i * kLanes + b] * (x[i * kLanes + b] - mean[b]) * inv[b]);
    }
    if (n_out != nullptr) {
      n_out[b] = n[b];
      mean_out[b] = mean[b];
      m2_out[b] = m2[b];
    }
  }
}

// Scale::kBatch: the unbiased std of all kept finite rewards of the batch from the per-group count, mean and sum
// of squared deviations (Chan's formula), 0 with fewer than 2 rewards. The CUDA kernel reduces the same sums in a
// block (batch_denominator_kernel).
double batch_std(const std::vector<double>& n, const std::vector<double>& mean, const std::vector<double>& m2) {
  double total = 0.0, weighted = 0.0;
  for (size_t g = 0; g < n.size(); ++g) {
    total += n[g];
    weighted += n[g] * mean[g];
  }
  const double batch_mean = weighted / std::max(total, 1.0);
  double batch_m2 = 0.0;
  for (size_t g = 0; g < n.size(); ++g) batch_m2 += m2[g] + n[g] * (mean[g] - batch_mean) * (mean[g] - batch_mean);
  return total >= 2.0 ? std::sqrt(batch_m2 / (total - 1.0)) : 0.0;
}

}  // namespace

GroupResult group_filter_advantages_cpu(const Tensor& rewards, const Tensor& scores, const Tensor& k, int64_t k_fixed,
                                        const Tensor& keep_in, bool largest, Scale scale, double eps) {
  const Tensor& shape_src = rewards.defined() ? rewards : scores;
  const int64_t num_groups = shape_src.size(0), G = shape_src.size(1);
  GroupResult out;
  if (scores.defined() || !keep_in.defined()) {
    out.keep = empty({num_groups, G}, ScalarType::Bool, shape_src);
  } else {
    out.keep = contiguous_as(keep_in, ScalarType::Bool);
  }
  bool* keep = out.keep.mutable_data_ptr<bool>();
  if (!scores.defined() && !keep_in.defined()) std::fill(keep, keep + num_groups * G, true);

  // Rewards are read as reward_read_type says and accumulated in double.
  const Tensor r = rewards.defined() ? contiguous_as(rewards, reward_read_type(rewards.scalar_type())) : undefined();
  const bool read_double = r.defined() && r.scalar_type() == ScalarType::Double;
  const float* rp = r.defined() && !read_double ? r.const_data_ptr<float>() : nullptr;
  const double* rdp = read_double ? r.const_data_ptr<double>() : nullptr;
  if (r.defined()) out.adv = empty({num_groups, G}, ScalarType::Float, r);
  float* ap = r.defined() ? out.adv.mutable_data_ptr<float>() : nullptr;
  // Scale::kBatch: the centred rewards wait for the batch std in double (r - mean of finite rewards near the
  // float32 or double range overflows float32, though the scaled advantage is finite)
  const bool batch = r.defined() && scale == Scale::kBatch;
  std::unique_ptr<double[]> adv_double;  // not zero-filled: every element is written
  std::vector<double> n, mean, m2;
  if (batch) {
    adv_double.reset(new double[num_groups * G]);
    n.resize(num_groups);
    mean.resize(num_groups);
    m2.resize(num_groups);
  }
  double* adp = adv_double.get();
  const Tensor s = scores.defined() ? contiguous_as(scores, scores.scalar_type()) : undefined();
  const Tensor kk = scores.defined() && k.defined() ? contiguous_as(k, ScalarType::Long) : undefined();
  const int64_t* kp = kk.defined() ? kk.const_data_ptr<int64_t>() : nullptr;
  const std::vector<int64_t> k_lanes(kLanes, k_fixed);  // k of every lane when one k holds for all groups

  dispatch_score_type(s.defined() ? s.scalar_type() : ScalarType::Float, [&](auto type_tag) {
    using scalar_t = decltype(type_tag);
    using key_t = key_type<scalar_t>;
    const scalar_t* sp = s.defined() ? static_cast<const scalar_t*>(s.const_data_ptr()) : nullptr;
    const int64_t grain = std::max<int64_t>(kLanes, 4096 / G);
    torch::stable::parallel_for(0, num_groups, grain, [&](int64_t begin, int64_t end) {
      std::vector<key_t> key(G * kLanes);
      std::vector<int64_t> order(G);
      std::vector<double> x(G * kLanes), w(G * kLanes);
      for (int64_t g0 = begin; g0 < end; g0 += kLanes) {
        const int64_t lanes = std::min(kLanes, end - g0);
        const scalar_t* sg = sp + g0 * G;
        if (sp != nullptr && G <= kMaxCountingGroupSize) {
          for (int64_t i = 0; i < G; ++i) {
            for (int64_t b = 0; b < kLanes; ++b) key[i * kLanes + b] = b < lanes ? order_key(sg[b * G + i], largest) : 0;
          }
          topk_by_counting(key.data(), G, lanes, kp ? kp + g0 : k_lanes.data(), keep + g0 * G);
        } else if (sp != nullptr) {
          for (int64_t b = 0; b < lanes; ++b) {
            for (int64_t i = 0; i < G; ++i) key[i] = order_key(sg[b * G + i], largest);
            topk_by_selection(key.data(), G, kp ? kp[g0 + b] : k_fixed, order.data(), keep + (g0 + b) * G);
          }
        }
        double* const n_g = batch ? n.data() + g0 : nullptr;
        double* const mean_g = batch ? mean.data() + g0 : nullptr;
        double* const m2_g = batch ? m2.data() + g0 : nullptr;
        const auto lanes_of = [&](const auto* rewards_g, auto* adv_g) {
          advantages_lanes(rewards_g + g0 * G, keep + g0 * G, G, lanes, scale, eps, x.data(), w.data(), adv_g + g0 * G,
                           n_g, mean_g, m2_g);
        };
        if (rp != nullptr && !batch) lanes_of(rp, ap);
        if (rp != nullptr && batch) lanes_of(rp, adp);
        if (rdp != nullptr && !batch) lanes_of(rdp, ap);
        if (rdp != nullptr && batch) lanes_of(rdp, adp);
      }
    });
  });
  if (batch) {
    const double denom = batch_std(n, mean, m2) + eps;
    torch::stable::parallel_for(0, num_groups * G, 32768, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) ap[i] = static_cast<float>(adp[i] / denom);
    });
  }
  return out;
}

namespace {

using Kernel = GroupResult (*)(const Tensor&, const Tensor&, const Tensor&, int64_t, const Tensor&, bool, Scale,
                               double);

// k: an int64 tensor of num_groups entries (adaptive k), or none and k_fixed for every group.
Tensor k_per_group(const std::optional<Tensor>& k, const Tensor& scores) {
  if (!k.has_value()) return undefined();
  GFPO_CHECK_VALUE(k->dim() == 1 && k->size(0) == scores.size(0), "k must have num_groups=", scores.size(0),
                   " entries, got shape ", shape_str(*k));
  return *k;
}

template <Kernel kernel>
Tensor group_topk_mask_op(const Tensor& scores, const std::optional<Tensor>& k, int64_t k_fixed, bool largest) {
  GFPO_CHECK_VALUE(scores.dim() == 2, "scores must be 2-D (num_groups, G), got ", scores.dim(), "-D");
  return kernel(undefined(), scores, k_per_group(k, scores), k_fixed, undefined(), largest, Scale::kGroup, 0.0).keep;
}

template <Kernel kernel>
Tensor group_advantages_op(const Tensor& rewards, const std::optional<Tensor>& keep, std::string_view scale,
                           double eps) {
  GFPO_CHECK_VALUE(rewards.dim() == 2, "rewards must be 2-D (num_groups, G), got ", rewards.dim(), "-D");
  GFPO_CHECK_VALUE(!keep.has_value() || keep->sizes().equals(rewards.sizes()), "keep must have the shape of rewards ",
                   shape_str(rewards), ", got ", shape_str(*keep));
  const Scale s = parse_scale(scale);
  return kernel(rewards, undefined(), undefined(), 0, keep.value_or(undefined()), false, s, eps).adv;
}

template <Kernel kernel>
std::tuple<Tensor, Tensor> gfpo_filter_advantages_op(const Tensor& rewards, const Tensor& scores,
                                                     const std::optional<Tensor>& k, int64_t k_fixed, bool largest,
                                                     std::string_view scale, double eps) {
  GFPO_CHECK_VALUE(rewards.dim() == 2 && rewards.sizes().equals(scores.sizes()),
                   "rewards and scores must be 2-D of one shape, got ", shape_str(rewards), " and ",
                   shape_str(scores));
  const Scale s = parse_scale(scale);
  GroupResult res = kernel(rewards, scores, k_per_group(k, scores), k_fixed, undefined(), largest, s, eps);
  return {res.keep, res.adv};
}

}  // namespace

}  // namespace gfpo

STABLE_TORCH_LIBRARY(gfpo, m) {
  // k: a tensor (adaptive k), or None and k_fixed for every group
  m.def("group_topk_mask(Tensor scores, Tensor? k, int k_fixed, bool largest) -> Tensor");
  m.def("group_advantages(Tensor rewards, Tensor? keep, str scale, float eps) -> Tensor");
  m.def(
      "gfpo_filter_advantages(Tensor rewards, Tensor scores, Tensor? k, int k_fixed, bool largest, str scale, "
      "float eps) "
      "-> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(gfpo, CPU, m) {
  m.impl("group_topk_mask", TORCH_BOX(&gfpo::group_topk_mask_op<gfpo::group_filter_advantages_cpu>));
  m.impl("group_advantages", TORCH_BOX(&gfpo::group_advantages_op<gfpo::group_filter_advantages_cpu>));
  m.impl("gfpo_filter_advantages", TORCH_BOX(&gfpo::gfpo_filter_advantages_op<gfpo::group_filter_advantages_cpu>));
}

#ifdef GFPO_WITH_CUDA
STABLE_TORCH_LIBRARY_IMPL(gfpo, CUDA, m) {
  m.impl("group_topk_mask", TORCH_BOX(&gfpo::group_topk_mask_op<gfpo::group_filter_advantages_cuda>));
  m.impl("group_advantages", TORCH_BOX(&gfpo::group_advantages_op<gfpo::group_filter_advantages_cuda>));
  m.impl("gfpo_filter_advantages", TORCH_BOX(&gfpo::gfpo_filter_advantages_op<gfpo::group_filter_advantages_cuda>));
}
#endif

// gfpo_kernels._C is imported only for the side effect of registering the ops above.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
