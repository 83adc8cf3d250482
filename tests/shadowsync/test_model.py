"""The built-in models, the table API (KeyedJaggedTensor, EmbeddingBagCollection) and the sharded path: a model's
collections swapped for the job's stores score exactly as the model with its own tables, for single- and
multi-valued features, sum and mean pooling, and tables of different widths."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cocosync.shadowsync.config import DataConfig, ModelConfig, TrainConfig
from cocosync.shadowsync.data.synth import EVAL, make_synthetic_dataset
from cocosync.shadowsync.job.run_model import Scorer, dense_parameters, run_model
from cocosync.shadowsync.metrics import evaluate
from cocosync.shadowsync.model.dlrm import DLRM
from cocosync.shadowsync.model.embeddings import gather_rows
from cocosync.shadowsync.model.factory import BUILTINS, build_model, factory_spec, resolve_factory
from cocosync.shadowsync.model.inputs import Feature, ModelInputs
from cocosync.shadowsync.model.shard import rowwise_update
from cocosync.shadowsync.model.sharding import TablePlan, active, load_tables, shard_model, table_weights
from cocosync.shadowsync.model.tables import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

DATA = DataConfig(table_size=2000)
KEYS = [f"C{i + 1}" for i in range(26)]


def _inputs(config: ModelConfig | None = None) -> ModelInputs:
    return ModelInputs(tuple(f"I{i + 1}" for i in range(13)), tuple(Feature(k, 2000) for k in KEYS),
                       config or ModelConfig())


def _batch(b=5):
    g = torch.Generator().manual_seed(0)
    return torch.rand(b, 13, generator=g), KeyedJaggedTensor.from_dense(KEYS, torch.randint(0, 2000, (b, 26),
                                                                                            generator=g))


def test_dlrm_shapes_parameter_split_and_init():
    m = DLRM(_inputs())
    dense, features = _batch()
    out = m(dense, features)
    assert out.shape == (5,) and out.dtype == torch.float32
    assert torch.allclose(torch.sigmoid(out), torch.full((5,), 0.04), atol=0.03)  # init_ctr bias
    tables = {id(w) for w in table_weights(m).values()}
    dense_ids = {id(p) for p in dense_parameters(m)}
    assert len(tables) == 26 and not dense_ids & tables and dense_ids | tables == {id(p) for p in m.parameters()}
    assert m.top[0].in_features == 16 + 27 * 26 // 2
    a, b = build_model("dlrm", _inputs(ModelConfig(seed=3))), build_model("dlrm", _inputs(ModelConfig(seed=3)))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    c = build_model("dlrm", _inputs(ModelConfig(seed=4)))
    assert not torch.equal(dense_parameters(a)[0], dense_parameters(c)[0])


@pytest.fixture
def one_thread():
    # 2 intra-op threads on a loaded 2-core machine are ~15x slower than 1 (spin-waiting); one is enough here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_adagrad_on_synthetic_data_reduces_ne(one_thread):
    torch.manual_seed(0)
    train = make_synthetic_dataset(64_000, seed=0, data=DATA)  # 250 steps of 256
    held_out = make_synthetic_dataset(10_000, seed=0, data=DATA, split=EVAL)
    m = Scorer(run_model(TrainConfig(data_options={"table_size": 2000}), DATA, ModelConfig(), sharded=False))
    opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
    before = evaluate(m, held_out.batches(4096))
    for b in train.batches(256):
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(m(b.dense, b.sparse), b.label).backward()
        opt.step()
    after = evaluate(m, held_out.batches(4096))
    assert before["ne"] > 0.98
    assert after["ne"] < 0.85 and after["auc"] > 0.8
    assert after["ne"] - after["bayes_ne"] < 0.2


def test_gather_rows_equals_advanced_indexing_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 8, generator=g, requires_grad=True)
    index = torch.randint(0, 50, (32, 5), generator=g)  # rows used many times: their gradients sum
    upstream = torch.randn(32, 5, 8, generator=g)
    ours = gather_rows(rows, index)
    ref = rows[index]
    assert torch.equal(ours, ref)
    (g_ours,) = torch.autograd.grad(ours, rows, upstream)
    (g_ref,) = torch.autograd.grad(ref, rows, upstream)
    assert torch.equal(g_ours, g_ref) and g_ours.abs().sum() > 0


def test_keyed_jagged_tensor_layout():
    kjt = KeyedJaggedTensor.from_lists({"a": [[1, 2], [], [3]], "b": [[4], [5], [6]]})
    assert kjt.keys() == ("a", "b") and kjt.stride() == 3
    assert kjt.lengths().tolist() == [2, 0, 1, 1, 1, 1] and kjt.values().tolist() == [1, 2, 3, 4, 5, 6]
    assert kjt["a"].to_list() == [[1, 2], [], [3]] and kjt["b"].offsets().tolist() == [0, 1, 2, 3]
    assert kjt.length_per_key() == [3, 3]
    assert kjt.head(2)["a"].to_list() == [[1, 2], []] and kjt.head(2)["b"].to_list() == [[4], [5]]
    dense = KeyedJaggedTensor.from_dense(["a", "b"], torch.tensor([[1, 4], [2, 5]]))
    assert dense.values().tolist() == [1, 2, 4, 5] and dense.lengths().tolist() == [1, 1, 1, 1]
    with pytest.raises(KeyError, match="no feature 'c'"):
        kjt["c"]
    with pytest.raises(ValueError, match="pooling='max'"):
        EmbeddingBagConfig("t", 10, 4, ("a",), "max")


class _Mixed(nn.Module):
    """Two collections, tables of widths 3 and 8 (one shared by two features), sum and mean pooling."""

    def __init__(self):
        super().__init__()
        self.users = EmbeddingBagCollection([EmbeddingBagConfig("u", 40, 3, ("user",))])
        self.items = EmbeddingBagCollection([EmbeddingBagConfig("tags", 30, 8, ("tags", "history"), "mean"),
                                             EmbeddingBagConfig("cat", 20, 8, ("cat",))])
        self.head = nn.Linear(2 + 3 + 8 * 3, 1)

    def forward(self, dense, features):
        x = torch.cat([dense, self.users(features).values(), self.items(features).values()], dim=1)
        return self.head(x).squeeze(1)


def _jagged(g, B=6):
    lists = {"user": [[int(torch.randint(0, 40, (), generator=g))] for _ in range(B)],
             "tags": [torch.randint(0, 30, (int(n),), generator=g).tolist()
                      for n in torch.randint(0, 5, (B,), generator=g)],
             "history": [torch.randint(0, 30, (int(n),), generator=g).tolist()
                         for n in torch.randint(0, 4, (B,), generator=g)],
             "cat": [[int(torch.randint(0, 20, (), generator=g))] for _ in range(B)]}
    return KeyedJaggedTensor.from_lists(lists)


def _sharded_logits(model, plan, table, dense, features):
    """The job's path: distinct global rows looked up from the whole row space, pooled by the plan."""
    ids = plan.row_ids(features)
    uniq, inverse = torch.unique(ids.view(-1), return_inverse=True)
    rows = table[uniq].clone().requires_grad_()
    looked = plan.looked_up(features, rows, inverse.view(ids.shape))
    with active(looked):
        return model(dense, looked), rows, uniq


def test_sharded_model_scores_as_the_model_with_its_own_tables():
    torch.manual_seed(0)
    plain = _Mixed()
    plan = TablePlan.of(plain)
    assert plan.width == 8 and plan.padded and plan.features == ("user", "tags", "history", "cat")
    table = torch.randn(plan.total_rows, plan.width)
    load_tables(plain, plan, table)
    sharded, _ = shard_model(_Mixed())
    sharded.load_state_dict({k: v for k, v in plain.state_dict().items() if "embedding_bags" not in k})
    assert not table_weights(sharded) and len(dense_parameters(sharded)) == 2
    g = torch.Generator().manual_seed(1)
    for features in (_jagged(g), _jagged(g, B=1)):
        dense = torch.randn(features.stride(), 2, generator=g)
        want = plain(dense, features)
        got, rows, uniq = _sharded_logits(sharded, plan, table, dense, features)
        torch.testing.assert_close(got, want)
        # the gradient of each distinct row equals the plain tables' gradient at that row
        want_grads = torch.autograd.grad(want.sum(), list(table_weights(plain).values()))
        full = torch.zeros(plan.total_rows, plan.width)
        for t, (start, g_t) in enumerate(zip(plan.table_offsets.tolist(), want_grads)):
            full[start:start + plan.tables[t].rows, :plan.tables[t].dim] = g_t
        (got_grad,) = torch.autograd.grad(got.sum(), rows)
        torch.testing.assert_close(got_grad, full[uniq])


class _PlainBags(nn.Module):
    """Tables as plain torch.nn.EmbeddingBag modules (each serving the feature of its attribute's name) beside a
    collection."""

    def __init__(self):
        super().__init__()
        self.user = nn.EmbeddingBag(40, 4, mode="sum")
        self.tags = nn.EmbeddingBag(30, 6, mode="mean")
        self.rest = EmbeddingBagCollection([EmbeddingBagConfig("c", 30, 6, ("cat", "history"))])
        self.head = nn.Linear(2 + 4 + 6 + 12, 1)

    def forward(self, dense, features):
        user, tags = features["user"], features["tags"]
        x = [dense, self.user(user.values, user.offsets()[:-1]), self.tags(tags.values, tags.offsets()[:-1]),
             self.rest(features).values()]
        return self.head(torch.cat(x, dim=1)).squeeze(1)


def test_plain_embedding_bags_are_tables_too():
    torch.manual_seed(0)
    plain = _PlainBags()
    plan = TablePlan.of(plain)
    assert [(t.name, t.features, t.pooling, t.bag) for t in plan.tables] == [
        ("user", ("user",), "sum", True), ("tags", ("tags",), "mean", True), ("c", ("cat", "history"), "sum", False)]
    table = torch.randn(plan.total_rows, plan.width)
    load_tables(plain, plan, table)
    sharded, _ = shard_model(_PlainBags())
    sharded.load_state_dict({k: v for k, v in plain.state_dict().items() if k.startswith("head")}, strict=False)
    assert [n for n, _ in sharded.named_parameters()] == ["head.weight", "head.bias"]
    features = _jagged(torch.Generator().manual_seed(2)).to_dict()
    features = KeyedJaggedTensor.from_lists({k: features[k].to_list() for k in plan.features})
    dense = torch.randn(features.stride(), 2)
    got, _, _ = _sharded_logits(sharded, plan, table, dense, features)
    torch.testing.assert_close(got, plain(dense, features))
    with pytest.raises(TypeError, match="only while the job trains"):
        sharded(dense, features)


def test_fill_padding_keeps_rowwise_adagrad_exact_for_narrow_tables():
    torch.manual_seed(0)
    plan = TablePlan.of(_Mixed())
    uniq = torch.tensor([0, 5, 39, 40, 75])  # rows of the 3-wide table, then of the 8-wide ones
    g = torch.randn(5, 8)
    g[:3, 3:] = 0  # what autograd gives the padding
    w = torch.randn(5, 8)
    narrow_w, narrow_acc = w[:3, :3].clone(), torch.zeros(3)
    rowwise_update(narrow_w, narrow_acc, torch.arange(3), g[:3, :3].clone(), "adagrad", 0.1, 1e-8)
    plan.fill_padding(uniq, g)
    padded_w, acc = w.clone(), torch.zeros(5)
    rowwise_update(padded_w, acc, torch.arange(5), g.clone(), "adagrad", 0.1, 1e-8)
    torch.testing.assert_close(padded_w[:3, :3], narrow_w)
    torch.testing.assert_close(acc[:3], narrow_acc)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_models_sharded_equal_plain(name):
    inputs = ModelInputs(("a", "b"), (Feature("x", 50), Feature("y", 30, True), Feature("z", 20)),
                         ModelConfig(embedding_dim=4, bottom_mlp=(8, 4), top_mlp=(8,)))
    plain = build_model(name, inputs)
    plan = TablePlan.of(plain)
    table = torch.randn(plan.total_rows, plan.width)
    load_tables(plain, plan, table)
    sharded, _ = shard_model(build_model(name, inputs))
    features = KeyedJaggedTensor.from_lists({"x": [[1], [2], [3]], "y": [[1, 2, 3], [], [29]], "z": [[0], [5], [19]]})
    dense = torch.randn(3, 2)
    got, _, _ = _sharded_logits(sharded, plan, table, dense, features)
    assert got.shape == (3,)
    torch.testing.assert_close(got, plain(dense, features))


def test_factory_specs_resolve_and_name_what_is_wrong(tmp_path):
    assert resolve_factory("dcn") is BUILTINS["dcn"] and factory_spec(BUILTINS["deepfm"]) == "deepfm"
    (tmp_path / "mine.py").write_text("from cocosync.shadowsync.model.dlrm import DLRM\n"
                                      "def make(inputs):\n    return DLRM(inputs)\n")
    assert resolve_factory(f"{tmp_path}/mine.py:make")(_inputs()).__class__.__name__ == "DLRM"
    from cocosync.shadowsync.config import ConfigError
    with pytest.raises(ConfigError, match="no 'nope'"):
        resolve_factory(f"{tmp_path}/mine.py:nope")
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg.models'"):
        resolve_factory("no_such_pkg.models:make")
    with pytest.raises(ConfigError, match="expected a built-in"):
        resolve_factory("resnet")


def test_a_snapshot_loads_into_plain_bags_and_collections_alike(tmp_path):
    from cocosync.shadowsync.data.sources import build_configs
    from cocosync.shadowsync.job.eval_curve import BestModel

    (tmp_path / "m.py").write_text(
        "import torch\nfrom torch import nn\nfrom cocosync.shadowsync import EmbeddingBagCollection, "
        "EmbeddingBagConfig\n\n"
        "class M(nn.Module):\n"
        "    def __init__(self, inputs):\n"
        "        super().__init__()\n"
        "        self.C1 = nn.EmbeddingBag(inputs.feature('C1').rows, 4, mode='sum')\n"
        "        self.rest = EmbeddingBagCollection([EmbeddingBagConfig('t2', inputs.feature('C2').rows, 8, ['C2'])])\n"
        "        self.out = nn.Linear(inputs.num_dense + 12, 1)\n\n"
        "    def forward(self, dense, f):\n"
        "        c1 = self.C1(f['C1'].values, f['C1'].offsets()[:-1])\n"
        "        return self.out(torch.cat([dense, c1, self.rest(f).values()], 1)).squeeze(1)\n\n"
        "def make(inputs):\n    return M(inputs)\n")
    cfg = TrainConfig(model_factory=f"{tmp_path}/m.py:make", data_options={"table_size": 50})
    data, model_cfg = build_configs(cfg)
    best = BestModel(cfg, data, model_cfg, [], None, {})
    plan = best.scorer.run.plan
    assert [t.name for t in plan.tables] == ["C1", "t2"] and plan.width == 8
    table = torch.randn(plan.total_rows, plan.width)
    model = best.load(torch.zeros(best.flat.flat.numel()), table).model
    assert torch.equal(model.C1.weight, table[:50, :4]) and torch.equal(model.rest.embedding_bags["t2"].weight,
                                                                        table[50:100])


def test_a_sharded_model_builds_its_tables_on_meta_without_torchs_compiler():
    """Every process of a job (the launcher, each rank) builds the sharded model: its tables live in the stores, so
    they are left uninitialized on meta. torch's init on meta imports torch._dynamo: ~1 s of CPU a process, a third of
    a small job's start."""
    import subprocess
    import sys

    code = ("import sys\nfrom cocosync.shadowsync.config import TrainConfig\n"
            "from cocosync.shadowsync.data.sources import build_configs\n"
            "from cocosync.shadowsync.job.run_model import run_model\n"
            "cfg = TrainConfig(examples=1000)\ndata, model_cfg = build_configs(cfg)\n"
            "model = run_model(cfg, data, model_cfg)\n"
            "assert model.plan.total_rows > 0\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
