"""MovieLens-100K as click-through data in the Criteo format: real users' ratings, as a registry package ships them.

Source: the RecBole 1.2.1 wheel on PyPI carries GroupLens' MovieLens-100K (100,000 ratings of 1,682 movies by 943
users, 1997-98) as three tab-separated files. `fetch_wheel` downloads that wheel with pip (nothing is installed:
only its data files are read) into a cache and checks its sha256; this project ships none of the data (GroupLens'
terms allow research use and ask that it not be redistributed).

Conversion, the usual rating-to-CTR convention (a click is a rating >= 4: 55% of the rows):
* 21 integer features: the user's age, the release year - 1900 (empty when unknown), 19 genre flags;
* 8 categoricals: user, movie, gender, occupation, zip code, age decade, release decade, first genre (the last three
  repeat integer features as categories, so that the model's interactions and the baselines' one-hot see them);
* one fixed permutation (`split_seed`) splits the ratings into train / valid / test: valid picks the best model
  (and a baseline's regularization), test scores them, and no model sees test rows before it is scored.

The real click logs a registry package ships (Open Bandit Dataset's sample in `obp`: 60,000 impressions, 287 clicks)
carry no signal at that size (logistic regression: NE 0.995-1.002 by 5-fold cross-validation; BENCHMARKS.md),
so they cannot tell two models apart by 1%; these ratings can.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

__all__ = ["WHEEL", "NUM_DENSE", "NUM_SPARSE", "MovieLensError", "fetch_wheel", "read_ratings", "write_ctr",
           "write_parquet", "table_size_for", "default_cache"]

WHEEL = {"package": "recbole", "version": "1.2.1", "file": "recbole-1.2.1-py3-none-any.whl",
         "sha256": "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407"}
_PREFIX = "recbole/dataset_example/ml-100k/ml-100k."
GENRES = ("Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
          "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western", "unknown")
NUM_DENSE = 2 + len(GENRES)
NUM_SPARSE = 8
SPLITS = ("train", "valid", "test")
# passes `cocosync data movielens` recommends: the best model on valid came after ~2 passes of the 80,000 training
# rows at the --help defaults (3 seeds); an eval point every tenth of a pass keeps it (BENCHMARKS.md)
EPOCHS = 3
#: embedding rows per distinct value of the largest categorical: categoricals are hashed into the tables, and a
#: value that shares its row with another is learnt as their blend. Test NE of the printed command against the
#: table size (5 seeds; chosen on valid, BENCHMARKS.md): 10,000 rows (the CLI default) -0.4 to -0.5% vs logistic
#: regression, 16,384 -0.7%, 32,768 -1.0%, 65,536 -1.5 to -1.6%, 131,072 -0.9%, 262,144 -0.3 to -0.8%.
ROWS_PER_VALUE = 32


class MovieLensError(RuntimeError):
    """The MovieLens files could not be had or read; the message says what to do."""


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cocosync"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(cache: Path | None = None, *, timeout: float = 300.0) -> Path:
    """The RecBole wheel holding MovieLens-100K, from `cache` or downloaded there by pip; its sha256 checked."""
    cache = Path(cache) if cache is not None else default_cache()
    path = cache / WHEEL["file"]
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
               "--disable-pip-version-check", f"{WHEEL['package']}=={WHEEL['version']}", "-d", str(cache)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise MovieLensError(f"pip download {WHEEL['package']}=={WHEEL['version']} took over {timeout:g} s: is "
                                 "the package registry reachable?") from None
        if done.returncode != 0 or not path.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise MovieLensError(f"pip could not download {WHEEL['package']}=={WHEEL['version']} into {cache} "
                                 f"({tail[0]}); put {WHEEL['file']} there by hand, or pass --cache DIR holding it")
    if (got := _sha256(path)) != WHEEL["sha256"]:
        raise MovieLensError(f"{path} has sha256 {got}, expected {WHEEL['sha256']}: not the wheel this converter "
                             "knows; delete it to download it again")
    return path


def _table(z: zipfile.ZipFile, name: str) -> list[list[str]]:
    lines = z.read(_PREFIX + name).decode("utf-8", errors="replace").splitlines()
    return [line.split("\t") for line in lines[1:] if line]


def read_ratings(wheel: Path) -> tuple[list[list[str]], dict, dict]:
    """(ratings [user, movie, rating, timestamp], users by id [id, age, gender, occupation, zip], movies by id
    [id, title, year, genres]) from the wheel."""
    try:
        with zipfile.ZipFile(wheel) as z:
            ratings = _table(z, "inter")
            users = {r[0]: r for r in _table(z, "user")}
            movies = {r[0]: r for r in _table(z, "item")}
    except (zipfile.BadZipFile, KeyError) as e:
        raise MovieLensError(f"{wheel}: not a wheel holding MovieLens-100K ({e})") from None
    return ratings, users, movies


def _line(rating: list[str], users: dict, movies: dict) -> str:
    user, movie = users[rating[0]], movies[rating[1]]
    genres = movie[3].split()
    year = movie[2] if movie[2].isdigit() else ""
    dense = [user[1], str(int(year) - 1900) if year else "", *("1" if g in genres else "0" for g in GENRES)]
    sparse = ["u" + rating[0], "m" + rating[1], user[2], user[3], user[4], f"a{int(user[1]) // 10}",
              f"y{year[:3]}" if year else "", f"g{genres[0]}" if genres else ""]
    return "\t".join(["1" if float(rating[2]) >= 4 else "0", *dense, *sparse])


def table_size_for(values: int) -> int:
    """Rows per embedding table for categoricals of up to `values` distinct values: the power of two at least
    ROWS_PER_VALUE x values (a value then shares its hashed row with another ~1/32 of the time)."""
    if values < 1:
        raise ValueError(f"values={values!r}: expected at least one distinct categorical value")
    return 1 << (ROWS_PER_VALUE * values - 1).bit_length()


def write_ctr(out: Path, wheel: Path, *, split_seed: int = 0, valid: float = 0.1, test: float = 0.1,
              max_rows: int | None = None) -> dict:
    """Write out/{train,valid,test}.tsv (Criteo format: label, NUM_DENSE integers, NUM_SPARSE categoricals) and
    out/meta.json; `max_rows`: the first rows of the permutation only (a small sample). Returns the meta."""
    ratings, users, movies = read_ratings(wheel)
    parts = _split(ratings, split_seed, valid, test, max_rows)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in SPLITS:
        path = out / f"{name}.tsv"
        lines = [_line(ratings[i], users, movies) for i in parts[name].tolist()]
        path.write_text("\n".join(lines) + "\n")
        clicks = sum(line[0] == "1" for line in lines)
        files[name] = {"path": str(path), "rows": len(lines), "ctr": clicks / max(1, len(lines))}
        if name == "train":  # the values a model can learn: one row each, ideally
            values = [{f[1 + NUM_DENSE + j] for f in (line.split("\t") for line in lines)} - {""}
                      for j in range(NUM_SPARSE)]
            cardinality = [len(v) for v in values]
    meta = {"source": f"MovieLens-100K (GroupLens), from PyPI {WHEEL['package']}=={WHEEL['version']}",
            "label": "rating >= 4", "num_dense": NUM_DENSE, "num_sparse": NUM_SPARSE, "split_seed": split_seed,
            "files": files, "epochs": EPOCHS, "eval_every": max(100, files["train"]["rows"] // 10),
            "cardinality": cardinality, "table_size": table_size_for(max(cardinality))}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _split(ratings: list, split_seed: int, valid: float, test: float, max_rows: int | None) -> dict[str, np.ndarray]:
    if not (0 < valid < 1 and 0 < test < 1 and valid + test < 1):
        raise ValueError(f"valid={valid!r}, test={test!r}: expected fractions in (0, 1) summing to less than 1")
    order = np.random.default_rng(split_seed).permutation(len(ratings))
    if max_rows is not None:
        order = order[:max_rows]
    n_test, n_valid = int(len(order) * test), int(len(order) * valid)
    return {"test": order[:n_test], "valid": order[n_test:n_test + n_valid], "train": order[n_test + n_valid:]}


def write_parquet(out: Path, wheel: Path, *, split_seed: int = 0, valid: float = 0.1, test: float = 0.1,
                  max_rows: int | None = None) -> dict:
    """Write out/{train,valid,test}.parquet with named columns (the same rows and split as `write_ctr`): label, age
    and year (dense), user_id, movie_id, gender, occupation, zip (strings) and genres (a list of strings, the
    movie's every genre), and out/meta.json. Returns the meta."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ratings, users, movies = read_ratings(wheel)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, rows in _split(ratings, split_seed, valid, test, max_rows).items():
        picked = [ratings[i] for i in rows.tolist()]
        user = [users[r[0]] for r in picked]
        movie = [movies[r[1]] for r in picked]
        table = pa.table({
            "label": pa.array([1 if float(r[2]) >= 4 else 0 for r in picked], pa.int8()),
            "age": pa.array([float(u[1]) for u in user]),
            "year": pa.array([float(m[2]) if m[2].isdigit() else None for m in movie], pa.float64()),
            "user_id": ["u" + r[0] for r in picked], "movie_id": ["m" + r[1] for r in picked],
            "gender": [u[2] for u in user], "occupation": [u[3] for u in user], "zip": [u[4] for u in user],
            "genres": [m[3].split() for m in movie]})
        path = out / f"{name}.parquet"
        pq.write_table(table, path)
        files[name] = {"path": str(path), "rows": table.num_rows,
                       "ctr": float(np.mean(table["label"].to_numpy())) if table.num_rows else 0.0}
    meta = {"source": f"MovieLens-100K (GroupLens), from PyPI {WHEEL['package']}=={WHEEL['version']}",
            "label": "rating >= 4", "format": "parquet", "split_seed": split_seed, "files": files, "epochs": EPOCHS,
            "eval_every": max(100, files["train"]["rows"] // 10)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta
