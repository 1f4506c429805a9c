// Decode attention over the paged KV cache, reading each sequence's blocks where they lie.
//
// The torch path gathers every decoding sequence's blocks into one contiguous tensor per layer and step, then runs
// two batched matmuls: the keys and values cross memory three times. Here each (sequence, key head) pair walks its
// block table once with an online softmax (running max and sum, the accumulator rescaled per block), so every key
// and value row is read once, and the next block is prefetched while this one is used (blocks lie anywhere in the
// pool, where no hardware prefetcher can guess them). Query heads sharing a key head are done together.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void decode(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
            const torch::Tensor& table, const torch::Tensor& pos, int64_t bs, float scale, int64_t window,
            const c10::optional<torch::Tensor>& new_k, const c10::optional<torch::Tensor>& new_v, torch::Tensor& out) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2), KVH = keys.size(0), DV = out.size(2);
  const int64_t G = H / KVH, B = table.size(1);
  const int64_t kh = keys.stride(0), kr = keys.stride(1), vh = values.stride(0), vr = values.stride(1);
  const scalar_t* Q = q.data_ptr<scalar_t>();
  scalar_t* K = keys.data_ptr<scalar_t>();
  scalar_t* V = values.data_ptr<scalar_t>();
  const int64_t* T = table.data_ptr<int64_t>();
  const int64_t* P = pos.data_ptr<int64_t>();
  scalar_t* O = out.data_ptr<scalar_t>();
  const int64_t k_bytes = bs * kr * sizeof(scalar_t), v_bytes = bs * vr * sizeof(scalar_t);
  // the step's own key/value of each sequence, [S, KVH, D] / [S, KVH, DV] (any strides), written at its position
  const scalar_t* NK = new_k ? new_k->data_ptr<scalar_t>() : nullptr;
  const scalar_t* NV = new_v ? new_v->data_ptr<scalar_t>() : nullptr;
  const int64_t nks = NK ? new_k->stride(0) : 0, nkh = NK ? new_k->stride(1) : 0, nkd = NK ? new_k->stride(2) : 0;
  const int64_t nvs = NV ? new_v->stride(0) : 0, nvh = NV ? new_v->stride(1) : 0, nvd = NV ? new_v->stride(2) : 0;
  const int64_t DK = keys.size(2), DVP = values.size(2);
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> qf(G * D), acc(G * DV), sb(bs), mx(G), sum(G);
    // sequences of an RL batch differ in length: small dynamic chunks keep the threads even
#pragma omp for schedule(dynamic, 4)
    for (int64_t w = 0; w < S * KVH; ++w) {
      const int64_t s = w / KVH, h = w % KVH, n = P[s] + 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(Q[(s * H + h * G + g) * D + d]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(sum.begin(), sum.end(), 0.f);
      scalar_t* Kh = K + h * kh;
      scalar_t* Vh = V + h * vh;
      const int64_t* tab = T + s * B;
      if (NK) {  // the row this step writes lies in the last block read below: written while it is near
        const int64_t row = tab[(n - 1) / bs] * bs + (n - 1) % bs;
        for (int64_t d = 0; d < DK; ++d) Kh[row * kr + d] = NK[s * nks + h * nkh + d * nkd];
        if (NV)
          for (int64_t d = 0; d < DVP; ++d) Vh[row * vr + d] = NV[s * nvs + h * nvh + d * nvd];
      }
      for (int64_t t = lo; t < n;) {
        const int64_t cnt = std::min(n, (t / bs + 1) * bs) - t;  // this block's keys from position t on
        const int64_t row = tab[t / bs] * bs + t % bs;
        if (t + cnt < n) {
          const char* nk = reinterpret_cast<const char*>(Kh + tab[(t + cnt) / bs] * bs * kr);
          const char* nv = reinterpret_cast<const char*>(Vh + tab[(t + cnt) / bs] * bs * vr);
          for (int64_t o = 0; o < k_bytes; o += 64) __builtin_prefetch(nk + o);
          for (int64_t o = 0; o < v_bytes; o += 64) __builtin_prefetch(nv + o);
        }
        const scalar_t* k = Kh + row * kr;
        const scalar_t* v = Vh + row * vr;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float m = t == lo ? std::numeric_limits<float>::lowest() : mx[g];
          for (int64_t i = 0; i < cnt; ++i) {
            const scalar_t* ki = k + i * kr;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(ki[d]);
            sb[i] = dot;
            m = std::max(m, dot);
          }
          const float rescale = t == lo ? 0.f : std::exp(mx[g] - m);  // nothing summed before the first block
          float z = sum[g] * rescale;
          float* a = acc.data() + g * DV;
#pragma omp simd
          for (int64_t d = 0; d < DV; ++d) a[d] *= rescale;
#pragma omp simd reduction(+ : z)
          for (int64_t i = 0; i < cnt; ++i) {
            sb[i] = std::exp(sb[i] - m);
            z += sb[i];
          }
          for (int64_t i = 0; i < cnt; ++i) {
            const scalar_t* vi = v + i * vr;
            const float p = sb[i];
#pragma omp simd
            for (int64_t d = 0; d < DV; ++d) a[d] += p * static_cast<float>(vi[d]);
          }
          mx[g] = m;
          sum[g] = z;
        }
        t += cnt;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / sum[g];
        for (int64_t d = 0; d < DV; ++d)
          O[(s * H + h * G + g) * DV + d] = static_cast<scalar_t>(acc[g * DV + d] * inv);
      }
    }
  }
}

}  // namespace

// q [S, H, D]; keys [KVH, rows, D] and values [KVH, rows, DV] (one layer's pool; values may be the keys' first DV
// dimensions, MLA's latent); table [S, B] block ids; pos [S] each query's position (it sees keys 0..pos, or the last
// `window` of them when window > 0); new_k [S, KVH, D] / new_v [S, KVH, DV]: when given, each sequence's key/value
// at its position, written into the pool first (new_v only where values have their own pool). Returns [S, H, DV].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor table,
                           torch::Tensor pos, int64_t block_size, double scale, int64_t window,
                           c10::optional<torch::Tensor> new_k, c10::optional<torch::Tensor> new_v) {
  TORCH_CHECK(q.device().is_cpu() && keys.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "paged_decode: q, keys, values must be 3-D");
  TORCH_CHECK(q.is_contiguous() && keys.stride(2) == 1 && values.stride(2) == 1,
              "paged_decode: q contiguous, pool rows contiguous");
  TORCH_CHECK(q.size(1) % keys.size(0) == 0 && q.size(2) == keys.size(2), "paged_decode: head shapes disagree");
  TORCH_CHECK(table.scalar_type() == torch::kLong && pos.scalar_type() == torch::kLong, "paged_decode: int64 indices");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "paged_decode: one dtype");
  TORCH_CHECK(!new_k || (new_k->dim() == 3 && new_k->size(0) == q.size(0) && new_k->size(1) == keys.size(0) &&
                          new_k->size(2) == keys.size(2) && new_k->scalar_type() == keys.scalar_type()),
              "paged_decode: new_k must be [S, KVH, D] in the pool's dtype");
  TORCH_CHECK(!new_v || (new_k && new_v->dim() == 3 && new_v->size(0) == q.size(0) &&
                          new_v->size(1) == values.size(0) && new_v->size(2) == values.size(2) &&
                          new_v->scalar_type() == values.scalar_type()),
              "paged_decode: new_v must be [S, KVH, DV] in the pool's dtype, with new_k");
  auto tab = table.contiguous();
  auto p = pos.contiguous();
  auto out = torch::empty({q.size(0), q.size(1), values.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q, keys, values, tab, p, block_size, static_cast<float>(scale), window, new_k, new_v, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (CPU)");
}
