// The shared-memory one-shot all_reduce's hot loop, out of Python: publish this rank's data and header, wait for the
// peers' arrival flags, check their headers agree, reduce every rank's copy in rank order. The same protocol and
// the same bits as the Python path (runtime/comm/collectives.py: begin_call + reduce_ranges), which stays the
// reference and handles every case this does not (timeouts and dead peers, mismatched headers, other ops/dtypes).
// Also the three-phase all_reduce's loop, and copies with streaming stores for the memory-bound large collectives.
#include <torch/extension.h>

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

namespace {

// memcpy with non-temporal stores: for data no core of this rank reads again soon (what it publishes for its peers,
// and large results). A plain store first reads the line it writes (read for ownership); a streaming store does not,
// so a copy moves 2 bytes per byte instead of 3. Large vectors here are memory-bound, so that is the time.
// Callers fence (stream_fence) before publishing an arrival flag.
inline void stream_copy(void* dst, const void* src, int64_t bytes) {
#if defined(__AVX512F__) || defined(__AVX2__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__AVX512F__)
  constexpr int64_t kVec = 64;
#else
  constexpr int64_t kVec = 32;
#endif
  const int64_t head = std::min<int64_t>(bytes, (kVec - reinterpret_cast<uintptr_t>(d) % kVec) % kVec);
  std::memcpy(d, s, head);
  d += head, s += head, bytes -= head;
  const int64_t body = bytes / kVec * kVec;
  for (int64_t i = 0; i < body; i += kVec) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
#else
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
#endif
  }
  std::memcpy(d + body, s + body, bytes - body);
#else
  std::memcpy(dst, src, bytes);
#endif
}

inline void stream_fence() {
#if defined(__AVX512F__) || defined(__AVX2__)
  _mm_sfence();
#endif
}

inline void copy(void* dst, const void* src, int64_t bytes, bool streaming) {
  if (streaming)
    stream_copy(dst, src, bytes);
  else
    std::memcpy(dst, src, bytes);
}

inline int64_t load_acquire(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

constexpr int kFields = 10;  // header words compared: collective, dtype, numel, op, root, (segment, offset), settings, tag

// dst = (src[0] + src[1] + ... ) * scale per element, in float32, in rank order (as the Python path: the same bits),
// in blocks so that each pass is a plain vectorizable loop
// pub: also copy each block of the result there (the three-phase publish, fused so the result is read from L1
// instead of memory; with streaming stores when stream_pub); stream: write dst itself with streaming stores
// (through a block buffer).
template <typename T>
void reduce_sum(const T* const* src, int64_t nsrc, T* dst, int64_t n, float scale, bool scaled,  // dst may be a src
                T* pub = nullptr, bool stream = false, bool stream_pub = false) {
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  alignas(64) T out[kBlock];
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
    T* d = stream ? out : dst + lo;
    for (int64_t j = 0; j < m; ++j) d[j] = static_cast<T>(acc[j]);
    if (stream) stream_copy(dst + lo, out, m * sizeof(T));
    if (pub != nullptr) copy(pub + lo, d, m * sizeof(T), stream_pub);
  }
}

}  // namespace

// One rank's view of the control words (slots of `slot` int64 words per local rank: the arrival counter at
// `seq_field`, the two alternating headers from `hdr_field`) and the constant header words of its all_reduce.
class OneShot {
 public:
  OneShot(int64_t words_addr, int64_t slot, int64_t local_rank, int64_t local_size, int64_t seq_field,
          int64_t hdr_field, int64_t hdr_words, std::vector<int64_t> header_template)
      : words_(reinterpret_cast<int64_t*>(words_addr)), slot_(slot), rank_(local_rank), size_(local_size),
        seq_field_(seq_field), hdr_field_(hdr_field), hdr_words_(hdr_words), template_(std::move(header_template)) {
    TORCH_CHECK(static_cast<int64_t>(template_.size()) <= hdr_words_, "OneShot: header template too long");
  }

  // Publish this rank's data and header for call `seq`, arrive, spin until every local rank arrived, then check the
  // headers and reduce into out. Returns 0 when done, 1 when a peer had not arrived after `spins` (the caller
  // waits in Python, which names a late or dead peer, then calls `finish`), 2 when the headers disagree (the
  // caller raises the Python path's error). Header words 1-3 (dtype, numel, op) come from the call.
  int64_t run(int64_t seq, int64_t dtype_code, int64_t op_code, int64_t ws_addr, int64_t region_bytes,
              const torch::Tensor& x, const torch::Tensor& out, double scale, bool scaled, int64_t spins) {
    const int64_t nbytes = x.numel() * x.element_size(), numel = x.numel();
    const void* data = x.data_ptr();
    write_header(seq, dtype_code, numel, op_code);
    {
      pybind11::gil_scoped_release no_gil;  // other threads of this process (a comm or shadow thread) run meanwhile
      std::memcpy(reinterpret_cast<char*>(ws_addr) + rank_ * region_bytes, data, nbytes);
      store_release(words_ + rank_ * slot_ + seq_field_, seq);
      if (!spin(seq, spins)) return 1;
    }
    return finish(seq, ws_addr, region_bytes, out, numel, scale, scaled);
  }

  // After every rank arrived at `seq`: 2 if the headers disagree, else reduce every rank's copy into out (0).
  int64_t finish(int64_t seq, int64_t ws_addr, int64_t region_bytes, const torch::Tensor& out, int64_t numel,
                 double scale, bool scaled) {
    const int64_t* mine = header(seq, rank_);
    for (int64_t r = 0; r < size_; ++r) {
      const int64_t* h = header(seq, r);
      for (int k = 0; k < kFields; ++k)
        if (k != 5 && k != 6 && h[k] != mine[k]) return 2;  // segment/offset may differ
    }
    std::vector<const void*> src(size_);
    for (int64_t r = 0; r < size_; ++r) src[r] = reinterpret_cast<const char*>(ws_addr) + r * region_bytes;
    const float s = static_cast<float>(scale);
    const auto dtype = out.scalar_type();
    void* dst = out.data_ptr();
    TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16 || dtype == torch::kHalf,
                "OneShot.finish: unsupported dtype ", dtype);
    pybind11::gil_scoped_release no_gil;
    if (dtype == torch::kFloat)
      reduce_sum(reinterpret_cast<const float* const*>(src.data()), size_, static_cast<float*>(dst), numel, s,
                 scaled);
    else if (dtype == torch::kBFloat16)
      reduce_sum(reinterpret_cast<const c10::BFloat16* const*>(src.data()), size_, static_cast<c10::BFloat16*>(dst),
                 numel, s, scaled);
    else
      reduce_sum(reinterpret_cast<const c10::Half* const*>(src.data()), size_, static_cast<c10::Half*>(dst), numel,
                 s, scaled);
    return 0;
  }

  // The three-phase all_reduce of a vector x in place (runtime/comm/collectives.py, _all_reduce_three_phase, on
  // one node with x outside the arena): phase 0 copies the ranges the peers reduce into this rank's workspace
  // region, publishes the header and arrives at `seq`; phase 1 checks the headers, reduces this rank's range (split
  // as reduction.split_bounds) from x and the peers' regions into x and its region, and arrives at seq + 1; phase 2
  // copies the peers' reduced ranges from their regions into x. Returns 0 when done, 1 (late at seq: call again
  // with phase 1 once every rank arrived), 3 (late at seq + 1: call again with phase 2), 2 (headers disagree), or
  // 4 (a peer's vector is an arena tensor, read in place: the caller finishes the call on the Python path).
  // stream_ws: write the workspace (what the peers read) with streaming stores; stream_x: x too (vectors too large
  // to stay in the caches, where skipping the read for ownership saves a third of a copy's memory traffic).
  int64_t three_phase(int64_t phase, int64_t seq, int64_t dtype_code, int64_t op_code, int64_t ws_addr,
                      int64_t region_bytes, const torch::Tensor& x, double scale, bool scaled, int64_t spins,
                      bool stream_ws, bool stream_x) {
    const int64_t numel = x.numel(), es = x.element_size();
    char* data = static_cast<char*>(x.data_ptr());
    char* ws = reinterpret_cast<char*>(ws_addr);
    const int64_t q = numel / size_, rem = numel % size_;
    auto lo = [&](int64_t r) { return r * q + std::min(r, rem); };
    if (phase == 0) {
      write_header(seq, dtype_code, numel, op_code);
      pybind11::gil_scoped_release no_gil;
      char* mine = ws + rank_ * region_bytes;
      for (int64_t r = 0; r < size_; ++r)
        if (r != rank_) copy(mine + lo(r) * es, data + lo(r) * es, (lo(r + 1) - lo(r)) * es, stream_ws);
      if (stream_ws) stream_fence();
      store_release(words_ + rank_ * slot_ + seq_field_, seq);
      if (!spin(seq, spins)) return 1;
      phase = 1;
    }
    if (phase == 1) {
      const int64_t* mine = header(seq, rank_);
      for (int64_t r = 0; r < size_; ++r) {
        const int64_t* h = header(seq, r);
        for (int k = 0; k < kFields; ++k)
          if (k != 5 && k != 6 && h[k] != mine[k]) return 2;
      }
      for (int64_t r = 0; r < size_; ++r)
        if (header(seq, r)[5] >= 0) return 4;  // word 5: the peer's arena segment (-1: copied into its region)
      const int64_t s = lo(rank_), n = lo(rank_ + 1) - s;
      std::vector<const void*> src(size_);
      for (int64_t r = 0; r < size_; ++r)
        src[r] = (r == rank_ ? data : ws + r * region_bytes) + s * es;
      const auto dtype = x.scalar_type();
      pybind11::gil_scoped_release no_gil;
      reduce(dtype, src, data + s * es, n, static_cast<float>(scale), scaled,  // and published for the peers
             ws + rank_ * region_bytes + s * es, stream_x, stream_ws);
      if (stream_x || stream_ws) stream_fence();
      store_release(words_ + rank_ * slot_ + seq_field_, seq + 1);
      if (!spin(seq + 1, spins)) return 3;
      phase = 2;
    }
    pybind11::gil_scoped_release no_gil;
    for (int64_t r = 0; r < size_; ++r)
      if (r != rank_) copy(data + lo(r) * es, ws + r * region_bytes + lo(r) * es, (lo(r + 1) - lo(r)) * es, stream_x);
    if (stream_x) stream_fence();
    return 0;
  }

 private:
  // This rank's header for call `seq`: the template with the call's dtype, element count and op (words 1-3).
  void write_header(int64_t seq, int64_t dtype_code, int64_t numel, int64_t op_code) {
    int64_t* hdr = header(seq, rank_);
    for (size_t k = 0; k < template_.size(); ++k) hdr[k] = template_[k];
    for (int64_t k = template_.size(); k < hdr_words_; ++k) hdr[k] = 0;
    hdr[1] = dtype_code;
    hdr[2] = numel;
    hdr[3] = op_code;
  }

  // At most `spins` polls and kSpinBudget of time: on a machine whose cores are all busy each sched_yield can give
  // away a whole time slice, and 4096 of them took ~6 s, while the Python wait the caller falls back to names a
  // dead peer within 0.2 s.
  bool spin(int64_t seq, int64_t spins) const {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t n = 0; !arrived(seq); ++n) {
      if (n >= spins) return false;
      if (n >= 64) {
        sched_yield();  // 2 cores shared by several ranks: let the peer run
        if ((n & 31) == 0 && std::chrono::steady_clock::now() - start > kSpinBudget) return false;
      }
    }
    return true;
  }

  static constexpr std::chrono::milliseconds kSpinBudget{20};

  static void reduce(c10::ScalarType dtype, const std::vector<const void*>& src, void* dst, int64_t n, float s,
                     bool scaled, void* pub, bool stream, bool stream_pub) {
    const int64_t k = src.size();
    if (dtype == torch::kFloat)
      reduce_sum(reinterpret_cast<const float* const*>(src.data()), k, static_cast<float*>(dst), n, s, scaled,
                 static_cast<float*>(pub), stream, stream_pub);
    else if (dtype == torch::kBFloat16)
      reduce_sum(reinterpret_cast<const c10::BFloat16* const*>(src.data()), k, static_cast<c10::BFloat16*>(dst), n,
                 s, scaled, static_cast<c10::BFloat16*>(pub), stream, stream_pub);
    else
      reduce_sum(reinterpret_cast<const c10::Half* const*>(src.data()), k, static_cast<c10::Half*>(dst), n, s,
                 scaled, static_cast<c10::Half*>(pub), stream, stream_pub);
  }

  int64_t* header(int64_t seq, int64_t r) const { return words_ + r * slot_ + hdr_field_ + (seq % 2) * hdr_words_; }

  bool arrived(int64_t seq) const {
    for (int64_t r = 0; r < size_; ++r)
      if (load_acquire(words_ + r * slot_ + seq_field_) < seq) return false;
    return true;
  }

  int64_t* words_;
  int64_t slot_, rank_, size_, seq_field_, hdr_field_, hdr_words_;
  std::vector<int64_t> template_;
};

// dst = src (contiguous, the same bytes) with streaming stores, fenced: for the large copies of the collectives'
// Python paths (all_gather, reduce_scatter), whose time is memory traffic.
void stream_copy_tensor(const torch::Tensor& dst, const torch::Tensor& src) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes(),
              "stream_copy: contiguous tensors of the same size expected, got ", dst.sizes(), " and ", src.sizes());
  pybind11::gil_scoped_release no_gil;
  stream_copy(dst.data_ptr(), src.data_ptr(), static_cast<int64_t>(dst.nbytes()));
  stream_fence();
}

// dst1 = dst2 = src (contiguous, the same bytes), reading src once (by blocks that stay in L2 for the second copy),
// with streaming stores, fenced: ShadowSync's round start (the live vector into its snapshot and the collective's
// buffer), where neither copy is read again before the collective has moved the whole vector through memory.
void stream_copy2_tensor(const torch::Tensor& dst1, const torch::Tensor& dst2, const torch::Tensor& src) {
  TORCH_CHECK(dst1.is_contiguous() && dst2.is_contiguous() && src.is_contiguous() && dst1.nbytes() == src.nbytes() &&
                  dst2.nbytes() == src.nbytes(),
              "stream_copy2: contiguous tensors of the same size expected, got ", dst1.sizes(), ", ", dst2.sizes(),
              " and ", src.sizes());
  constexpr int64_t kBlock = 64 << 10;
  const int64_t bytes = static_cast<int64_t>(src.nbytes());
  char* d1 = static_cast<char*>(dst1.data_ptr());
  char* d2 = static_cast<char*>(dst2.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  pybind11::gil_scoped_release no_gil;
  for (int64_t lo = 0; lo < bytes; lo += kBlock) {
    const int64_t m = std::min(kBlock, bytes - lo);
    stream_copy(d1 + lo, s + lo, m);
    stream_copy(d2 + lo, s + lo, m);
  }
  stream_fence();
}

void register_lookup_rounds(pybind11::module& m);   // lookup_rounds.cpp
void register_embedding_rows(pybind11::module& m);  // embedding_rows.cpp
void register_hot_rows(pybind11::module& m);        // hot_rows.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_lookup_rounds(m);
  register_embedding_rows(m);
  register_hot_rows(m);
  m.def("stream_copy", &stream_copy_tensor);
  m.def("stream_copy2", &stream_copy2_tensor);
  pybind11::class_<OneShot>(m, "OneShot")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, std::vector<int64_t>>())
      .def("run", &OneShot::run)
      .def("finish", &OneShot::finish)
      .def("three_phase", &OneShot::three_phase);
}
