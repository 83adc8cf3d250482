"""A model written outside the package, as README shows it (two tables of different widths, one list-valued
feature), trained by ShadowSync on a Parquet file of string categoricals and a list column: `cocosync train --model`
(T=2, shadow-bmuf), stopped and resumed from its checkpoint, scored by `cocosync eval`, exported and scored again by
`cocosync predict` and by the exported model in Python (the same scores), from Python's `train`, and across two
loopback nodes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cocosync.runtime.comm.shm import leftover_segments
from cocosync.shadowsync import load_model
from cocosync.shadowsync.metrics import normalized_entropy
from cocosync.testing.multinode import run_nodes

MODEL = textwrap.dedent('''
    import torch
    from torch import nn
    from cocosync.shadowsync import EmbeddingBagCollection, EmbeddingBagConfig


    class Small(nn.Module):
        def __init__(self, inputs):
            super().__init__()
            rows = {f.name: f.rows for f in inputs.features}
            self.tables = EmbeddingBagCollection([
                EmbeddingBagConfig("item", rows["item_id"], 16, ["item_id"]),
                EmbeddingBagConfig("small", max(rows["color"], rows["tags"]), 8, ["color", "tags"], pooling="mean"),
            ])
            self.deep = nn.Sequential(nn.Linear(inputs.num_dense + 32, 32), nn.ReLU(), nn.Linear(32, 1))

        def forward(self, dense, features):
            return self.deep(torch.cat([dense, self.tables(features).values()], dim=1)).squeeze(1)


    def make(inputs):
        return Small(inputs)
''')


def _rows(n, seed):
    rng = np.random.default_rng(seed)
    color = rng.integers(0, 10, n)
    tags = [rng.integers(0, 200, k) for k in rng.integers(1, 8, n)]
    w_tag = np.random.default_rng(99).normal(0, 1.0, 200)
    logit = -1 + 0.5 * (color - 5) / 3 + np.array([w_tag[t].mean() for t in tags])
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    return pa.table({"label": y, "price": rng.normal(0, 3, n), "color": [f"c{c}" for c in color],
                     "item_id": [f"i{v}" for v in rng.integers(0, 5000, n)],
                     "tags": [[f"t{v}" for v in t] for t in tags]})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    (d / "mymodel.py").write_text(MODEL)
    pq.write_table(_rows(40_000, 0), d / "train.parquet", row_group_size=8192)
    pq.write_table(_rows(3_000, 1), d / "held.parquet")
    return d


def _cocosync(*args, timeout=240):
    r = subprocess.run([sys.executable, "-m", "cocosync_start", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_your_model_trains_resumes_scores_exports_and_predicts(files, tmp_path):
    run, spec = tmp_path / "run", f"{files}/mymodel.py:make"
    common = ["--data", files / "train.parquet", "--model", spec, "-T", 2, "--sync", "shadow-bmuf", "--examples",
              30_000, "--eval-examples", 4000, "--out", run, "--no-progress"]
    first = _cocosync("train", *common, "--stop-after", 12_000)
    assert "tags[list]" in first.stderr and "table small: " in first.stderr and "stored 16 wide" in first.stderr
    _cocosync("train", "--resume", run, "--out", run, "--no-progress")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["examples"] + summary["resumed_from"] == 30_000 and summary["eval_ne"] < 0.95
    ev = json.loads(_cocosync("eval", run, "--data", files / "held.parquet", "--json").stdout)
    assert ev["ne"] < 0.95 and ev["examples"] == 3000
    _cocosync("export", run, tmp_path / "exp")
    _cocosync("predict", tmp_path / "exp", "--data", files / "held.parquet", "--out", tmp_path / "s.parquet")
    _cocosync("predict", run, "--data", files / "held.parquet", "--out", tmp_path / "s2.parquet")
    scores = pq.read_table(tmp_path / "s.parquet")
    p, y = scores["score"].to_numpy(), scores["label"].to_numpy()
    assert np.array_equal(p, pq.read_table(tmp_path / "s2.parquet")["score"].to_numpy())
    assert normalized_entropy(y, p) == pytest.approx(ev["ne"], abs=1e-5)  # predict scores as eval does
    model = load_model(tmp_path / "exp")  # in Python: the user's own class, full tables, raw rows in
    assert type(model.model).__name__ == "Small" and model.model.tables.embedding_bags["small"].weight.shape[1] == 8
    raw = pq.read_table(files / "held.parquet").drop(["label"]).slice(0, 100)
    assert np.allclose(model.predict_rows(raw), p[:100], atol=1e-6)
    assert leftover_segments() == []


def test_python_train_with_a_factory_defined_in_a_script(files, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(files)!r})
        from mymodel import Small
        from cocosync.shadowsync import TrainConfig, train

        def make(inputs):
            return Small(inputs)

        if __name__ == "__main__":  # every rank loads this file for `make`
            result = train(make, {str(files / "train.parquet")!r}, TrainConfig(trainers=2, examples=8000,
                           eval_examples=2000, out_dir={str(tmp_path / "py")!r}, progress=False))
            print("NE", result.summary["eval_ne"], result.summary["examples"])
    '''))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                       env={**__import__("os").environ, "PYTHONPATH": str(files)})
    assert r.returncode == 0, r.stderr[-3000:]
    ne, examples = r.stdout.split()[-2:]
    assert int(examples) == 8000 and float(ne) < 1.0
    saved = json.loads((tmp_path / "py" / "job.json").read_text())
    assert saved["config"]["model_factory"] == f"{script}:make"


@pytest.mark.parametrize("transport", ["exchange", "node-exchange"])
def test_your_model_across_two_loopback_nodes(files, tmp_path, transport):
    """The list feature's rows through each lookup transport between machines (a trainer's own exchange, or its
    relay to the node's exchange) and the nodes' replicas of the hot rows."""
    out = tmp_path / "run"
    runs = run_nodes(["-m", "cocosync.shadowsync", "--data", str(files / "train.parquet"), "--model",
                      f"{files}/mymodel.py:make", "--examples", "20000", "--eval-examples", "2000", "--sync",
                      "shadow-bmuf", "--lookup-transport", transport, "--out", str(out)], nproc_per_node=2,
                     timeout=240)
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    # the other node's rows through the exchange, the hottest from the node's replica (a list feature's ids too)
    assert (s["nodes"], s["T"], s["examples"], s["lookup_transport"]) == (2, 2, 20000, transport)
    assert s["remote_row_fraction"] > 0 and s["hot_row_fraction"] > 0.5
    assert s["eval_ne"] < 1.0


def test_a_file_that_is_no_exported_model_is_named(tmp_path):
    import torch

    from cocosync.shadowsync.config import ConfigError

    torch.save([1, 2, 3], tmp_path / "model.pt")
    with pytest.raises(ConfigError, match=r"not an exported model of this cocosync \(format 'list'"):
        load_model(tmp_path)
    with pytest.raises(ConfigError, match="no exported model there"):
        load_model(tmp_path / "elsewhere")
