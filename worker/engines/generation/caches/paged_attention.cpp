// Decode attention over a paged KV cache, read in place (no gather into a dense copy).
//
// One query token per row, grouped-query heads: q [B, H, D] (any float dtype; read as fp32), keys
// [blocks, kv heads, D, BLOCK] (each block's keys d-major, so a block's scores are vector FMAs over its positions),
// values [blocks, kv heads, BLOCK, D] (fp32 or bf16, read as fp32), table [B, max blocks] int32 (row b's blocks in
// order), positions [B] int64 (row b attends to its positions first..positions[b], first = positions[b] - window + 1
// with a window, else 0). Work items are (row, kv head, part): a long row with few rows beside it is split into
// `parts` position ranges whose softmax partials (max, sum, weighted values) are merged at the end, as
// flash-decoding does. Scores, the softmax and the values' sum are fp32. Returns [B, H, D] fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <cmath>
#include <vector>
#include <limits>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t BS = 16;  // positions per block: caches/paged_cache.py BLOCK
constexpr int64_t W = Vec::size();
static_assert(BS % W == 0, "a block is whole vectors");
constexpr int64_t NV = BS / W;  // vectors per block row of positions

template <typename T>
static inline const float* as_float(const T* src, float* tmp, int64_t n) {
  if constexpr (std::is_same_v<T, float>) { return src; } else {
    for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(src[i]);
    return tmp;
  }
}

// scores[g][0..BS) = q[g] . K[:, j] for a block's keys stored d-major [D, BS]; NG queries at once.
template <int NG>
static inline void block_scores(const float* qs, int64_t D, const float* k, float* const* out) {
  Vec acc[NG][NV];
  for (int g = 0; g < NG; ++g) for (int v = 0; v < NV; ++v) acc[g][v] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    Vec kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = Vec::loadu(k + d * BS + v * W);
    for (int g = 0; g < NG; ++g) {
      Vec qv(qs[g * D + d]);
      for (int v = 0; v < NV; ++v) acc[g][v] = at::vec::fmadd(qv, kv[v], acc[g][v]);
    }
  }
  for (int g = 0; g < NG; ++g) for (int v = 0; v < NV; ++v) acc[g][v].store(out[g] + v * W);
}

// acc[g][0..D) += sum_j p[g][j] * V[j, :] for a block's values [BS, D]; NG queries at once, 2 vectors of d a pass
// (a head_dim that is not a multiple of 2 vectors finishes element by element).
template <int NG>
static inline void block_values(const float* const* p, int64_t D, const float* v, float* const* acc) {
  const int64_t whole = D - D % (2 * W);
  for (int64_t d = whole; d < D; ++d)
    for (int g = 0; g < NG; ++g)
      for (int64_t j = 0; j < BS; ++j) acc[g][d] += p[g][j] * v[j * D + d];
  for (int64_t d0 = 0; d0 < whole; d0 += 2 * W) {
    Vec a[NG][2];
    for (int g = 0; g < NG; ++g) { a[g][0] = Vec::loadu(acc[g] + d0); a[g][1] = Vec::loadu(acc[g] + d0 + W); }
    for (int64_t j = 0; j < BS; ++j) {
      Vec v0 = Vec::loadu(v + j * D + d0), v1 = Vec::loadu(v + j * D + d0 + W);
      for (int g = 0; g < NG; ++g) {
        Vec pv(p[g][j]);
        a[g][0] = at::vec::fmadd(pv, v0, a[g][0]);
        a[g][1] = at::vec::fmadd(pv, v1, a[g][1]);
      }
    }
    for (int g = 0; g < NG; ++g) { a[g][0].store(acc[g] + d0); a[g][1].store(acc[g] + d0 + W); }
  }
}

template <typename F>
static inline void by_groups(int64_t G, F&& f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t ng = std::min<int64_t>(4, G - g0);
    switch (ng) {
      case 1: f(std::integral_constant<int, 1>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      default: f(std::integral_constant<int, 4>{}, g0); break;
    }
  }
}

template <typename T>
static void run(const torch::Tensor& q, const torch::Tensor& kp, const torch::Tensor& vp, const torch::Tensor& table,
                const torch::Tensor& positions, int64_t window, double scale, int64_t parts, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = kp.size(1), maxnb = table.size(1);
  const int64_t G = H / KV;
  const float* qd = q.data_ptr<float>();
  const T* kd = kp.data_ptr<T>();
  const T* vd = vp.data_ptr<T>();
  const int32_t* td = table.data_ptr<int32_t>();
  const int64_t* pd = positions.data_ptr<int64_t>();
  float* od = out.data_ptr<float>();
  const float NEG = -std::numeric_limits<float>::infinity();
  std::vector<float> pmax(B * KV * parts * G), psum(B * KV * parts * G), pacc(B * KV * parts * G * D);
  at::parallel_for(0, B * KV * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(G * D), tmp(BS * D);
    std::vector<float*> rows(G), accs(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bk = item / parts, part = item % parts, b = bk / KV, kv = bk % KV;
      const int64_t last = pd[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      const int64_t fb = first / BS, lb = last / BS, nblk = lb - fb + 1;
      const int64_t per = (nblk + parts - 1) / parts;
      const int64_t b0 = fb + part * per, b1 = std::min(lb + 1, b0 + per);
      float* my_max = pmax.data() + item * G;
      float* my_sum = psum.data() + item * G;
      float* my_acc = pacc.data() + item * G * D;
      std::fill(my_acc, my_acc + G * D, 0.f);
      for (int64_t g = 0; g < G; ++g) { my_max[g] = NEG; my_sum[g] = 0.f; }
      if (b0 >= b1) continue;
      const int64_t n = (b1 - b0) * BS;
      scores.resize(G * n);
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t d = 0; d < D; ++d) qs[g * D + d] = qd[(b * H + kv * G + g) * D + d] * (float)scale;
        accs[g] = my_acc + g * D;
      }
      for (int64_t blkn = b0; blkn < b1; ++blkn) {
        const int64_t blk = td[b * maxnb + blkn];
        const float* k = as_float(kd + (blk * KV + kv) * D * BS, tmp.data(), D * BS);
        for (int64_t g = 0; g < G; ++g) rows[g] = scores.data() + g * n + (blkn - b0) * BS;
        by_groups(G, [&](auto ng, int64_t g0) { block_scores<decltype(ng)::value>(qs.data() + g0 * D, D, k, rows.data() + g0); });
      }
      const int64_t base = b0 * BS;
      const int64_t lo = std::max<int64_t>(0, first - base), hi = std::min<int64_t>(n, last - base + 1);
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * n;
        for (int64_t i = 0; i < lo; ++i) sc[i] = NEG;
        for (int64_t i = hi; i < n; ++i) sc[i] = NEG;
        Vec mv(NEG);
        for (int64_t i = 0; i < n; i += W) mv = at::vec::maximum(mv, Vec::loadu(sc + i));
        const float m = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mv);
        Vec mm(m), total(0.f);
        for (int64_t i = 0; i < n; i += W) { Vec e = (Vec::loadu(sc + i) - mm).exp_u20(); e.store(sc + i); total = total + e; }
        my_max[g] = m;
        my_sum[g] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, total);
      }
      for (int64_t blkn = b0; blkn < b1; ++blkn) {
        const int64_t blk = td[b * maxnb + blkn];
        const float* v = as_float(vd + (blk * KV + kv) * BS * D, tmp.data(), D * BS);
        for (int64_t g = 0; g < G; ++g) rows[g] = scores.data() + g * n + (blkn - b0) * BS;
        by_groups(G, [&](auto ng, int64_t g0) { block_values<decltype(ng)::value>(rows.data() + g0, D, v, accs.data() + g0); });
      }
    }
  });
  for (int64_t bk = 0; bk < B * KV; ++bk) {
    const int64_t b = bk / KV, kv = bk % KV;
    for (int64_t g = 0; g < G; ++g) {
      float m = NEG;
      for (int64_t p = 0; p < parts; ++p) m = std::max(m, pmax[(bk * parts + p) * G + g]);
      float sum = 0.f;
      float* o = od + (b * H + kv * G + g) * D;
      std::fill(o, o + D, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const float pm = pmax[(bk * parts + p) * G + g];
        if (pm == NEG) continue;
        const float f = std::exp(pm - m);
        sum += f * psum[(bk * parts + p) * G + g];
        const float* a = pacc.data() + ((bk * parts + p) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += f * a[d];
      }
      for (int64_t d = 0; d < D; ++d) o[d] /= sum;
    }
  }
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kp, torch::Tensor vp, torch::Tensor table,
                           torch::Tensor positions, int64_t window, double scale, int64_t parts) {
  TORCH_CHECK(q.dim() == 3 && kp.dim() == 4 && vp.dim() == 4, "q [B, H, D], keys and values [blocks, kv, ...]");
  TORCH_CHECK(kp.size(3) == BS && vp.size(2) == BS && kp.size(2) == q.size(2), "blocks of 16 positions, same D");
  TORCH_CHECK(q.size(1) % kp.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(kp.is_contiguous() && vp.is_contiguous(), "keys and values must be contiguous");
  TORCH_CHECK(kp.scalar_type() == vp.scalar_type(), "keys and values of one dtype");
  TORCH_CHECK(kp.scalar_type() == torch::kFloat || kp.scalar_type() == torch::kBFloat16, "fp32 or bf16 cache");
  TORCH_CHECK(table.scalar_type() == torch::kInt && table.is_contiguous(), "an int32 table");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous(), "int64 positions");
  TORCH_CHECK(parts >= 1, "parts >= 1");
  auto qf = q.to(torch::kFloat).contiguous();
  auto out = torch::empty_like(qf);
  if (kp.scalar_type() == torch::kFloat) run<float>(qf, kp, vp, table, positions, window, scale, parts, out);
  else run<c10::BFloat16>(qf, kp, vp, table, positions, window, scale, parts, out);
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
