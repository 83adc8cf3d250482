// Row-wise Adagrad on embedding rows in one pass over the touched rows, out of Python: the update of
// shadowsync/model/embeddings.py `rowwise_update` (its torch path, ~8 tensor operations and their temporaries, stays
// the reference; the same result up to float rounding: the torch path sums a row's squares in another order).
// Lock-free as the torch path (Hogwild): workers and the lookup exchange apply rows of shared-memory tables at once.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

namespace {

// The same steps as the reference, in its order: g += wd * w (every row read before any is written); acc += mean(g^2)
// for every occurrence (rows may repeat); then each occurrence steps with the final accumulator of its row.
// fp-contract off: w += g * s rounds the product, as index_add_ of a scaled tensor does.
__attribute__((optimize("fp-contract=off"))) void rowwise_adagrad(torch::Tensor weight, torch::Tensor accumulator,
                                                                   torch::Tensor rows, torch::Tensor grads, double lr,
                                                                   double eps, double weight_decay) {
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 2 && weight.is_contiguous(),
              "rowwise_adagrad: contiguous float32 weight [rows, dim]");
  TORCH_CHECK(accumulator.scalar_type() == torch::kFloat32 && accumulator.is_contiguous() &&
                  accumulator.numel() == weight.size(0),
              "rowwise_adagrad: a float32 accumulator per row");
  const int64_t n = rows.numel(), dim = weight.size(1), table = weight.size(0);
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.is_contiguous(), "rowwise_adagrad: int64 rows");
  TORCH_CHECK(grads.scalar_type() == torch::kFloat32 && grads.is_contiguous() && grads.numel() == n * dim,
              "rowwise_adagrad: contiguous float32 gradients [len(rows), dim]");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(r[i] >= 0 && r[i] < table, "rowwise_adagrad: row ", r[i], " out of range");
  float *w = weight.data_ptr<float>(), *acc = accumulator.data_ptr<float>(), *g = grads.data_ptr<float>();
  const float wd = static_cast<float>(weight_decay), e = static_cast<float>(eps), neg_lr = static_cast<float>(-lr);
  if (wd != 0.0f) {
    for (int64_t i = 0; i < n; ++i) {
      const float* wr = w + r[i] * dim;
      float* gi = g + i * dim;
      for (int64_t j = 0; j < dim; ++j) gi[j] += wd * wr[j];
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* gi = g + i * dim;
    float sq = 0.0f;
    for (int64_t j = 0; j < dim; ++j) sq += gi[j] * gi[j];
    acc[r[i]] += sq / static_cast<float>(dim);
  }
  for (int64_t i = 0; i < n; ++i) {
    const float s = (1.0f / (std::sqrt(acc[r[i]]) + e)) * neg_lr;
    float* wr = w + r[i] * dim;
    const float* gi = g + i * dim;
    for (int64_t j = 0; j < dim; ++j) wr[j] += gi[j] * s;
  }
}

}  // namespace

void register_embedding_rows(pybind11::module& m) {
  m.def("rowwise_adagrad", &rowwise_adagrad, pybind11::call_guard<pybind11::gil_scoped_release>());
}
