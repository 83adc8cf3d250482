// The replicated hot rows' sync (shadowsync/model/hot_rows.py), one pass each side of the all-reduce instead of
// ~20 tensor operations whose fixed cost dominated at a few thousand rows: `pack_changes` writes what this node
// changed since the last sync into the all-reduce's buffer, `merge_changes` adds the other nodes' changes to the
// replica and the sum to the consensus. The functions of the same names in hot_rows.py are the reference (same bits:
// the same float operations in the same order). Lock-free: workers update the replica while it runs (Hogwild).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

namespace {

struct Rows {
  float *w, *acc, *base_w, *base_acc;
  int64_t *ver, *base_v;
  int64_t H, dim;
};

Rows check(torch::Tensor weight, torch::Tensor acc, torch::Tensor versions, torch::Tensor base_w,
           torch::Tensor base_acc, torch::Tensor base_v, torch::Tensor buf, const char* what) {
  const int64_t H = weight.size(0), dim = weight.dim() == 2 ? weight.size(1) : 0;
  TORCH_CHECK(weight.dim() == 2 && base_w.sizes() == weight.sizes(), what, ": weight and base [rows, dim]");
  for (const auto& t : {weight, acc, base_w, base_acc, buf})
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), what, ": contiguous float32 tensors");
  for (const auto& t : {versions, base_v})
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.numel() == H, what, ": int64 versions");
  TORCH_CHECK(acc.numel() == H && base_acc.numel() == H, what, ": an accumulator per row");
  TORCH_CHECK(buf.numel() >= H * (dim + 2), what, ": a buffer of rows * (dim + 2) floats");
  return {weight.data_ptr<float>(), acc.data_ptr<float>(), base_w.data_ptr<float>(), base_acc.data_ptr<float>(),
          versions.data_ptr<int64_t>(), base_v.data_ptr<int64_t>(), H, dim};
}

// out = [weight - base (H x dim) | acc - base_acc (H) | versions - base_v (H)]
void pack_changes(torch::Tensor weight, torch::Tensor acc, torch::Tensor versions, torch::Tensor base_w,
                  torch::Tensor base_acc, torch::Tensor base_v, torch::Tensor out) {
  const Rows r = check(weight, acc, versions, base_w, base_acc, base_v, out, "pack_changes");
  float* o = out.data_ptr<float>();
  const int64_t n = r.H * r.dim;
  for (int64_t i = 0; i < n; ++i) o[i] = r.w[i] - r.base_w[i];
  for (int64_t i = 0; i < r.H; ++i) o[n + i] = r.acc[i] - r.base_acc[i];
  for (int64_t i = 0; i < r.H; ++i) o[n + r.H + i] = static_cast<float>(r.ver[i] - r.base_v[i]);
}

// others = total - mine; replica += others; base += total (counts rounded to integers); returns
// sum(mine_count * others_count) / 2, the staleness estimate of hot_rows.py.
double merge_changes(torch::Tensor weight, torch::Tensor acc, torch::Tensor versions, torch::Tensor base_w,
                     torch::Tensor base_acc, torch::Tensor base_v, torch::Tensor total, torch::Tensor mine) {
  const Rows r = check(weight, acc, versions, base_w, base_acc, base_v, total, "merge_changes");
  TORCH_CHECK(mine.scalar_type() == torch::kFloat32 && mine.is_contiguous() && mine.numel() >= r.H * (r.dim + 2),
              "merge_changes: this node's changes as packed");
  const float *t = total.data_ptr<float>(), *m = mine.data_ptr<float>();
  const int64_t n = r.H * r.dim;
  for (int64_t i = 0; i < n; ++i) {
    r.w[i] += t[i] - m[i];
    r.base_w[i] += t[i];
  }
  for (int64_t i = 0; i < r.H; ++i) {
    r.acc[i] += t[n + i] - m[n + i];
    r.base_acc[i] += t[n + i];
  }
  double stale = 0.0;
  for (int64_t i = 0; i < r.H; ++i) {
    const float tc = t[n + r.H + i], mc = m[n + r.H + i], oc = tc - mc;
    r.ver[i] += static_cast<int64_t>(std::nearbyint(oc));
    r.base_v[i] += static_cast<int64_t>(std::nearbyint(tc));
    stale += static_cast<double>(mc * oc);
  }
  return stale / 2.0;
}

}  // namespace

void register_hot_rows(pybind11::module& m) {
  m.def("pack_changes", &pack_changes, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("merge_changes", &merge_changes, pybind11::call_guard<pybind11::gil_scoped_release>());
}
