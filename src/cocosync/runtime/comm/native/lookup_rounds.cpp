// The lookup exchange's per-round work on rows, out of Python (shadowsync/model/exchange.py): a round's lookups
// deduplicated and ordered by node, its pushes stably ordered by node (`sort_lookups`, `sort_pushes`), and every
// peer's message written into one send buffer (`pack_messages`). The same bits as the Python paths there, which stay
// the references: torch.unique over (node << 40 | row) keys, a stable argsort by node, tensors concatenated. Python
// spent ~20 tensor operations per round sorting and ~6 per peer packing. Also the trainer's per-batch deduplication
// (`distinct_rows`, shadowsync/model/embeddings.py), with the same hashing, and where its rows live (`split_rows`).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
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

// A batch's distinct global rows (ascending) and each id's position in them, for ids [B, T] (T tables) of table-local
// rows with `offsets` [T] (the first global row of each table): torch.unique((sparse + offsets).view(-1),
// return_inverse=True), the trainer's reference, in one hashing pass and a sort of the distinct rows only (torch
// sorts every id: ~250 us of a batch of 256 x 26 ids here, this ~1/3 of it).
std::vector<torch::Tensor> distinct_rows(const torch::Tensor& sparse, const torch::Tensor& offsets) {
  TORCH_CHECK(sparse.scalar_type() == torch::kInt64 && sparse.is_contiguous() && sparse.dim() == 2,
              "distinct_rows: contiguous int64 ids [batch, tables]");
  TORCH_CHECK(offsets.scalar_type() == torch::kInt64 && offsets.is_contiguous() && offsets.dim() == 1 &&
                  offsets.numel() == sparse.size(1),
              "distinct_rows: int64 offsets, one per table");
  const int64_t B = sparse.size(0), T = sparse.size(1), n = B * T;
  const int64_t* ids = sparse.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  auto inverse = torch::empty({B, T}, torch::kInt64);
  int64_t* inv = inverse.data_ptr<int64_t>();
  KeyIndex index(n);
  std::vector<int64_t> rows;  // distinct, in first-occurrence order
  rows.reserve(n);
  for (int64_t b = 0, i = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t, ++i) {
      const int64_t row = ids[i] + off[t];
      TORCH_CHECK(row >= 0, "distinct_rows: a negative row id");
      auto [slot, fresh] = index.insert(row, static_cast<int64_t>(rows.size()));
      if (fresh) rows.push_back(row);
      inv[i] = slot;
    }
  }
  const int64_t k = static_cast<int64_t>(rows.size());
  std::vector<int64_t> order(k), rank(k);
  for (int64_t s = 0; s < k; ++s) order[s] = s;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rows[a] < rows[b]; });
  auto uniq = torch::empty({k}, torch::kInt64);
  int64_t* u = uniq.data_ptr<int64_t>();
  for (int64_t s = 0; s < k; ++s) {
    rank[order[s]] = s;
    u[s] = rows[order[s]];
  }
  for (int64_t i = 0; i < n; ++i) inv[i] = rank[inv[i]];
  return {uniq, inverse};
}

// Where a batch's distinct rows live, with the lookup exchange (ShardedEmbeddings._split, its reference): `uniq`
// (ascending global rows) against the node's replicated `hot` rows (ascending) by one merge walk, the rest by owner
// (row % servers): {hot positions, their slots, local positions grouped by server (ascending within it), their
// local rows (row / servers), rows per server (local servers only), remote positions}.
std::vector<torch::Tensor> split_rows(const torch::Tensor& uniq, const torch::Tensor& hot,
                                      const torch::Tensor& is_local) {
  TORCH_CHECK(uniq.scalar_type() == torch::kInt64 && uniq.is_contiguous() && uniq.dim() == 1,
              "split_rows: contiguous int64 rows");
  TORCH_CHECK(hot.scalar_type() == torch::kInt64 && hot.is_contiguous() && hot.dim() == 1,
              "split_rows: contiguous int64 hot rows");
  TORCH_CHECK(is_local.scalar_type() == torch::kBool && is_local.is_contiguous() && is_local.numel() > 0,
              "split_rows: one bool per server");
  const int64_t U = uniq.numel(), H = hot.numel(), S = is_local.numel();
  const int64_t* u = uniq.data_ptr<int64_t>();
  const int64_t* h = hot.data_ptr<int64_t>();
  const bool* local = is_local.data_ptr<bool>();
  std::vector<int64_t> hot_pos, hot_slot, remote_pos, owner(U, -1);
  auto counts = torch::zeros({S}, torch::kInt64);
  int64_t* c = counts.data_ptr<int64_t>();
  int64_t j = 0;
  for (int64_t i = 0; i < U; ++i) {
    TORCH_CHECK(i == 0 || u[i] > u[i - 1], "split_rows: rows must be distinct and ascending");
    while (j < H && h[j] < u[i]) ++j;
    if (j < H && h[j] == u[i]) {
      hot_pos.push_back(i), hot_slot.push_back(j);
      continue;
    }
    const int64_t s = u[i] % S;
    if (local[s]) {
      owner[i] = s, ++c[s];
    } else {
      remote_pos.push_back(i);
    }
  }
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) start[s + 1] = start[s] + c[s];
  auto local_pos = torch::empty({start[S]}, torch::kInt64), local_rows = torch::empty({start[S]}, torch::kInt64);
  int64_t* lp = local_pos.data_ptr<int64_t>();
  int64_t* lr = local_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < U; ++i) {
    if (owner[i] >= 0) {
      const int64_t at = start[owner[i]]++;
      lp[at] = i, lr[at] = u[i] / S;
    }
  }
  auto as_tensor = [](const std::vector<int64_t>& v) {
    auto t = torch::empty({static_cast<int64_t>(v.size())}, torch::kInt64);
    if (!v.empty()) std::memcpy(t.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
    return t;
  };
  return {as_tensor(hot_pos), as_tensor(hot_slot), local_pos, local_rows, counts, as_tensor(remote_pos)};
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

// One round's messages, every peer's, written into one send buffer (the bytes of `pack_messages`'s Python path):
// per peer p != me: its header (4 int64), the answer owed to it (staleness, versions, rows; absent: nothing), and
// this trainer's request padded to the room p announced ([looked, pushed], ids, pushed ids, versions, gradients;
// no room: nothing). Python built and concatenated ~6 tensors per peer.
std::tuple<torch::Tensor, std::vector<int64_t>> pack_messages(
    int64_t me, const torch::Tensor& heads, const std::vector<int64_t>& stale, const std::vector<torch::Tensor>& versions,
    const std::vector<torch::Tensor>& rows, const std::vector<bool>& owed, const torch::Tensor& ids,
    const std::vector<int64_t>& lb, const torch::Tensor& push_ids, const torch::Tensor& push_versions,
    const torch::Tensor& grads, const std::vector<int64_t>& pb, const std::vector<int64_t>& cap_l,
    const std::vector<int64_t>& cap_k, int64_t dim) {
  const int64_t n = heads.size(0);
  TORCH_CHECK(heads.scalar_type() == torch::kInt64 && heads.is_contiguous() && heads.size(1) == 4,
              "pack_messages: int64 headers [nodes, 4]");
  TORCH_CHECK(static_cast<int64_t>(stale.size()) == n && static_cast<int64_t>(versions.size()) == n &&
                  static_cast<int64_t>(rows.size()) == n && static_cast<int64_t>(owed.size()) == n &&
                  static_cast<int64_t>(lb.size()) == n + 1 && static_cast<int64_t>(pb.size()) == n + 1 &&
                  static_cast<int64_t>(cap_l.size()) == n && static_cast<int64_t>(cap_k.size()) == n,
              "pack_messages: one entry per node");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.is_contiguous() && push_ids.scalar_type() == torch::kInt64 &&
                  push_ids.is_contiguous() && push_versions.scalar_type() == torch::kInt64 &&
                  push_versions.is_contiguous() && grads.scalar_type() == torch::kFloat32 && grads.is_contiguous(),
              "pack_messages: contiguous int64 ids and versions, float32 gradients");
  auto align = [](int64_t b) { return (b + 7) / 8 * 8; };
  std::vector<int64_t> sizes(n, 0);
  int64_t total = 0;
  for (int64_t p = 0; p < n; ++p) {
    if (p == me) continue;
    int64_t s = 32;
    if (owed[p]) {
      TORCH_CHECK(versions[p].scalar_type() == torch::kInt64 && versions[p].is_contiguous() &&
                      rows[p].scalar_type() == torch::kFloat32 && rows[p].is_contiguous() &&
                      rows[p].numel() == versions[p].numel() * dim,
                  "pack_messages: an answer's int64 versions and float32 rows [looked, dim]");
      s += 8 * (1 + versions[p].numel()) + align(4 * rows[p].numel());
    }
    if (cap_l[p] || cap_k[p]) {
      TORCH_CHECK(lb[p + 1] - lb[p] <= cap_l[p] && pb[p + 1] - pb[p] <= cap_k[p],
                  "pack_messages: a request larger than the room its peer announced");
      s += 16 + 8 * (cap_l[p] + 2 * cap_k[p]) + align(4 * cap_k[p] * dim);
    }
    sizes[p] = s;
    total += s;
  }
  auto buf = torch::zeros({total}, torch::kUInt8);  // padding and alignment bytes are zeros, as Python's
  char* out = reinterpret_cast<char*>(buf.data_ptr<uint8_t>());
  auto put = [&out](const void* src, int64_t bytes) {
    if (bytes) std::memcpy(out, src, bytes);
    out += bytes;
  };
  const int64_t* h = heads.data_ptr<int64_t>();
  for (int64_t p = 0; p < n; ++p) {
    if (p == me) continue;
    char* start = out;
    put(h + 4 * p, 32);
    if (owed[p]) {
      put(&stale[p], 8);
      put(versions[p].data_ptr<int64_t>(), 8 * versions[p].numel());
      put(rows[p].data_ptr<float>(), 4 * rows[p].numel());
      out = start + 32 + 8 * (1 + versions[p].numel()) + align(4 * rows[p].numel());
    }
    if (cap_l[p] || cap_k[p]) {
      const int64_t L = lb[p + 1] - lb[p], K = pb[p + 1] - pb[p];
      const int64_t counts[2] = {L, K};
      char* req = out;
      put(counts, 16);
      put(ids.data_ptr<int64_t>() + lb[p], 8 * L);
      out = req + 16 + 8 * cap_l[p];
      if (cap_k[p]) {
        put(push_ids.data_ptr<int64_t>() + pb[p], 8 * K);
        out += 8 * (cap_k[p] - K);
        put(push_versions.data_ptr<int64_t>() + pb[p], 8 * K);
        out += 8 * (cap_k[p] - K);
        put(grads.data_ptr<float>() + pb[p] * dim, 4 * K * dim);
      }
      out = req + 16 + 8 * (cap_l[p] + 2 * cap_k[p]) + align(4 * cap_k[p] * dim);
    }
    TORCH_CHECK(out - start == sizes[p], "pack_messages: internal size mismatch");
  }
  return {buf, sizes};
}

}  // namespace

void register_lookup_rounds(pybind11::module& m) {
  m.def("distinct_rows", &distinct_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("split_rows", &split_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sort_lookups", &sort_lookups, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sort_pushes", &sort_pushes, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack_messages", &pack_messages, pybind11::call_guard<pybind11::gil_scoped_release>());
}
