// The lookup exchange's per-round sorting, out of Python (shadowsync/model/exchange.py, `_sorted`): a round's
// lookups deduplicated and ordered by node, its pushes stably ordered by node. The same bits as the Python path,
// which stays the reference: torch.unique over (node << 40 | row) keys, a stable argsort by node. Python spent ~20
// tensor operations (~0.5 ms per round of two batches) on what is one pass over the rows here.
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kNodeShift = 40;

inline int64_t node_of(int64_t row, int64_t servers, int64_t per_node) { return (row % servers) / per_node; }

// Open addressing over non-negative int64 keys (-1: empty); returns each key's first-occurrence slot.
class KeyIndex {
 public:
  explicit KeyIndex(int64_t n) {
    int64_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    mask_ = cap - 1;
    keys_.assign(cap, -1);
    slots_.resize(cap);
  }
  // (slot of key, whether it was new); a new key takes slot `next`
  std::pair<int64_t, bool> insert(int64_t key, int64_t next) {
    uint64_t h = (static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> 20;
    for (int64_t i = h & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == key) return {slots_[i], false};
      if (keys_[i] < 0) {
        keys_[i] = key, slots_[i] = next;
        return {next, true};
      }
    }
  }

 private:
  int64_t mask_;
  std::vector<int64_t> keys_, slots_;
};

// The round's lookups: the distinct rows of `parts` (int64 global rows), node-major and ascending within a node;
// where[i] = position of the i-th row (the parts concatenated) in them; rows per node.
std::vector<torch::Tensor> sort_lookups(const std::vector<torch::Tensor>& parts, int64_t servers, int64_t per_node,
                                        int64_t nodes) {
  int64_t total = 0;
  for (const auto& p : parts) {
    TORCH_CHECK(p.scalar_type() == torch::kInt64 && p.is_contiguous() && p.dim() == 1, "sort_lookups: int64 rows");
    total += p.numel();
  }
  auto where = torch::empty({total}, torch::kInt64);
  int64_t* w = where.data_ptr<int64_t>();
  KeyIndex index(total);
  std::vector<int64_t> keys;  // distinct, in first-occurrence order
  keys.reserve(total);
  int64_t i = 0;
  for (const auto& p : parts) {
    const int64_t* r = p.data_ptr<int64_t>();
    for (int64_t j = 0; j < p.numel(); ++j, ++i) {
      const int64_t key = (node_of(r[j], servers, per_node) << kNodeShift) | r[j];
      auto [slot, fresh] = index.insert(key, static_cast<int64_t>(keys.size()));
      if (fresh) keys.push_back(key);
      w[i] = slot;
    }
  }
  const int64_t k = static_cast<int64_t>(keys.size());
  std::vector<int64_t> order(k);
  for (int64_t s = 0; s < k; ++s) order[s] = s;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  std::vector<int64_t> rank(k);
  auto ids = torch::empty({k}, torch::kInt64);
  auto counts = torch::zeros({nodes}, torch::kInt64);
  int64_t* out = ids.data_ptr<int64_t>();
  int64_t* c = counts.data_ptr<int64_t>();
  constexpr int64_t kRowMask = (int64_t{1} << kNodeShift) - 1;
  for (int64_t s = 0; s < k; ++s) {
    rank[order[s]] = s;
    out[s] = keys[order[s]] & kRowMask;
    ++c[keys[order[s]] >> kNodeShift];
  }
  for (int64_t t = 0; t < total; ++t) w[t] = rank[w[t]];
  return {ids, where, counts};
}

// The round's pushes: rows, versions and float32 gradients of `parts` concatenated and stably ordered by node;
// rows per node.
std::vector<torch::Tensor> sort_pushes(const std::vector<torch::Tensor>& rows, const std::vector<torch::Tensor>& versions,
                                       const std::vector<torch::Tensor>& grads, int64_t servers, int64_t per_node,
                                       int64_t nodes, int64_t dim) {
  TORCH_CHECK(rows.size() == versions.size() && rows.size() == grads.size(), "sort_pushes: one entry per push");
  int64_t total = 0;
  for (size_t p = 0; p < rows.size(); ++p) {
    TORCH_CHECK(rows[p].scalar_type() == torch::kInt64 && versions[p].scalar_type() == torch::kInt64 &&
                    rows[p].is_contiguous() && versions[p].is_contiguous() && versions[p].numel() == rows[p].numel(),
                "sort_pushes: int64 rows and versions of one length");
    TORCH_CHECK(grads[p].scalar_type() == torch::kFloat32 && grads[p].is_contiguous() &&
                    grads[p].numel() == rows[p].numel() * dim,
                "sort_pushes: contiguous float32 gradients [rows, dim]");
    total += rows[p].numel();
  }
  auto counts = torch::zeros({nodes}, torch::kInt64);
  int64_t* c = counts.data_ptr<int64_t>();
  std::vector<int64_t> node(total);
  int64_t i = 0;
  for (const auto& r : rows) {
    const int64_t* x = r.data_ptr<int64_t>();
    for (int64_t j = 0; j < r.numel(); ++j, ++i) ++c[node[i] = node_of(x[j], servers, per_node)];
  }
  std::vector<int64_t> at(nodes + 1, 0);
  for (int64_t n = 0; n < nodes; ++n) at[n + 1] = at[n] + c[n];
  auto ids = torch::empty({total}, torch::kInt64);
  auto vers = torch::empty({total}, torch::kInt64);
  auto g = torch::empty({total, dim}, torch::kFloat32);
  int64_t *oi = ids.data_ptr<int64_t>(), *ov = vers.data_ptr<int64_t>();
  float* og = g.data_ptr<float>();
  i = 0;
  for (size_t p = 0; p < rows.size(); ++p) {
    const int64_t *x = rows[p].data_ptr<int64_t>(), *v = versions[p].data_ptr<int64_t>();
    const float* gr = grads[p].data_ptr<float>();
    for (int64_t j = 0; j < rows[p].numel(); ++j, ++i) {
      const int64_t to = at[node[i]]++;
      oi[to] = x[j], ov[to] = v[j];
      std::memcpy(og + to * dim, gr + j * dim, dim * sizeof(float));
    }
  }
  return {ids, vers, g, counts};
}

}  // namespace

void register_lookup_rounds(pybind11::module& m) {
  m.def("sort_lookups", &sort_lookups, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sort_pushes", &sort_pushes, pybind11::call_guard<pybind11::gil_scoped_release>());
}
