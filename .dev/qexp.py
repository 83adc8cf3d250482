"""T=alg vs T=1 at equal examples, seeds, paired; variants through env vars (temporary trainer hooks)."""
import json, os, sys, statistics as st
from pathlib import Path
from cocosync.bench.quality import _train, _quiet

def _train_var(alg, T, seed, base, out):
    iv = os.environ.get("CS_INTERVAL")
    if iv is None:
        return _train(alg, T, seed, base, out, _quiet())
    from cocosync.shadowsync.job.launch import run_training
    from cocosync.shadowsync.train_config import SyncConfig, TrainConfig
    cfg = TrainConfig(**base, trainers=T, seed=seed, sync=SyncConfig(algorithm=alg, interval=float(iv)),
                      out_dir=str(out / f"{alg}-T{T}-s{seed}"))
    res = run_training(cfg, name="x", console=_quiet())
    s = res.summary
    return {"eval_ne": s["eval_ne"], "sync_gap": s["sync_gap"]}


def main():
    alg, T, examples, seeds, tag = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    ref_tag = sys.argv[6] if len(sys.argv) > 6 else "ref"
    out = Path("/tmp/qexp"); out.mkdir(exist_ok=True)
    base = dict(examples=examples, eval_examples=20000 if examples <= 400000 else 50000, checkpoint=False, plot=False,
                progress=False)
    cache = out / "cache.json"
    db = json.loads(cache.read_text()) if cache.exists() else {}
    diffs = []
    first = int(os.environ.get("CS_FIRST_SEED", "0"))
    for seed in range(first, first + seeds):
        rk = f"{ref_tag}/{examples}/{seed}"
        if rk not in db:
            db[rk] = _train("none", 1, seed, base, out / "r", _quiet())["eval_ne"]
            cache.write_text(json.dumps(db))
        r = _train_var(alg, T, seed, base, out / "t")
        d = 100 * (r["eval_ne"] / db[rk] - 1)
        diffs.append(d)
        print(f"{tag} {alg} T={T} {examples} seed {seed}: {r['eval_ne']:.4f} vs {db[rk]:.4f} {d:+.2f}% gap {r['sync_gap']:.1f}", flush=True)
    m = st.mean(diffs); sd = st.stdev(diffs) if len(diffs) > 1 else float("nan")
    print(f"RESULT {tag} {alg} T={T} {examples}: mean {m:+.2f}% sd {sd:.2f} (90% +-{1.645*sd/len(diffs)**0.5:.2f}) per seed {[round(x,2) for x in diffs]}", flush=True)

if __name__ == "__main__":
    main()
