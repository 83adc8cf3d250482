// The shared-memory one-shot all_reduce's hot loop, out of Python: publish this rank's data and header, wait for the
// peers' arrival flags, check their headers agree, reduce every rank's copy in rank order. The same protocol and
// the same bits as the Python path (runtime/comm/collectives.py: begin_call + reduce_ranges), which stays the
// reference and handles every case this does not (timeouts and dead peers, mismatched headers, other ops/dtypes).
#include <torch/extension.h>

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

inline int64_t load_acquire(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

constexpr int kFields = 10;  // header words compared: collective, dtype, numel, op, root, (segment, offset), settings, tag

// dst = (src[0] + src[1] + ... ) * scale per element, in float32, in rank order (as the Python path: the same bits),
// in blocks so that each pass is a plain vectorizable loop
template <typename T>
void reduce_sum(const T* const* src, int64_t nsrc, T* __restrict dst, int64_t n, float scale, bool scaled) {
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  for (int64_t lo = 0; lo < n; lo += kBlock) {
    const int64_t m = std::min(kBlock, n - lo);
    const T* __restrict s0 = src[0] + lo;
    for (int64_t j = 0; j < m; ++j) acc[j] = static_cast<float>(s0[j]);
    for (int64_t r = 1; r < nsrc; ++r) {
      const T* __restrict sr = src[r] + lo;
      for (int64_t j = 0; j < m; ++j) acc[j] += static_cast<float>(sr[j]);
    }
    if (scaled)
      for (int64_t j = 0; j < m; ++j) acc[j] *= scale;
    T* __restrict d = dst + lo;
    for (int64_t j = 0; j < m; ++j) d[j] = static_cast<T>(acc[j]);
  }
}

}  // namespace

// Returns 0 when done, 1 when a peer had not arrived after the spin budget (the caller waits in Python, which names
// a late or dead peer, then calls `finish`), 2 when the headers disagree (the caller raises the Python error).
int64_t publish(int64_t words_addr, int64_t slot, int64_t local_rank, int64_t local_size, int64_t seq,
                int64_t seq_field, int64_t hdr_field, std::vector<int64_t> hdr, int64_t ws_addr, int64_t region_bytes,
                const torch::Tensor& x, int64_t spin_budget) {
  auto* words = reinterpret_cast<int64_t*>(words_addr);
  const int64_t nbytes = x.numel() * x.element_size();
  const void* data = x.data_ptr();
  pybind11::gil_scoped_release no_gil;  // other threads of this process (a comm or shadow thread) run meanwhile
  std::memcpy(reinterpret_cast<char*>(ws_addr) + local_rank * region_bytes, data, nbytes);
  int64_t* mine = words + local_rank * slot + hdr_field;
  for (size_t k = 0; k < hdr.size(); ++k) mine[k] = hdr[k];
  store_release(words + local_rank * slot + seq_field, seq);
  for (int64_t spins = 0;; ++spins) {
    bool all = true;
    for (int64_t r = 0; r < local_size && all; ++r) all = load_acquire(words + r * slot + seq_field) >= seq;
    if (all) return 0;
    if (spins >= spin_budget) return 1;
    if (spins >= 64) sched_yield();  // 2 cores shared by several ranks: let the peer run
  }
}

int64_t finish(int64_t words_addr, int64_t slot, int64_t local_rank, int64_t local_size, int64_t hdr_field,
               int64_t ws_addr, int64_t region_bytes, const torch::Tensor& out, int64_t numel, double scale,
               bool scaled) {
  auto* words = reinterpret_cast<int64_t*>(words_addr);
  const int64_t* mine = words + local_rank * slot + hdr_field;
  for (int64_t r = 0; r < local_size; ++r) {
    const int64_t* h = words + r * slot + hdr_field;
    for (int k = 0; k < kFields; ++k)
      if (k != 5 && k != 6 && h[k] != mine[k]) return 2;  // segment/offset may differ
  }
  std::vector<const void*> src(local_size);
  for (int64_t r = 0; r < local_size; ++r) src[r] = reinterpret_cast<const char*>(ws_addr) + r * region_bytes;
  const float s = static_cast<float>(scale);
  const auto dtype = out.scalar_type();
  void* dst = out.data_ptr();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf,
              "one_shot.finish: unsupported dtype ", dtype);
  pybind11::gil_scoped_release no_gil;
  if (dtype == torch::kFloat)
    reduce_sum(reinterpret_cast<const float* const*>(src.data()), local_size, static_cast<float*>(dst), numel, s,
               scaled);
  else if (dtype == torch::kBFloat16)
    reduce_sum(reinterpret_cast<const c10::BFloat16* const*>(src.data()), local_size,
               static_cast<c10::BFloat16*>(dst), numel, s, scaled);
  else
    reduce_sum(reinterpret_cast<const c10::Half* const*>(src.data()), local_size, static_cast<c10::Half*>(dst),
               numel, s, scaled);
  return 0;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("publish", &publish, "copy in, header, arrive, spin until every local rank arrived (or the budget ends)");
  m.def("finish", &finish, "check the headers agree, reduce every rank's copy in rank order into out");
}
