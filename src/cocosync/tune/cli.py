"""`cocosync tune FILE.py|adam|lamb|sgd|megatron|bmuf [--ranks P] [--json PATH]`: the tuner's table and choice;
`cocosync tune one-shot|kernel-bytes|eager-work`: a runtime constant measured and saved."""

from __future__ import annotations

from typing import Any

import click


@click.command("tune")
@click.argument("target")
@click.option("--ranks", type=click.IntRange(2, 64), default=2, show_default=True, help="local ranks to time on.")
@click.option("--nodes", type=click.IntRange(1, 64), default=1, show_default=True,
              help="simulate this many nodes on this host (torchrun's layout, gloo between them); must divide --ranks.")
@click.option("--repeats", type=click.IntRange(1), default=7, show_default=True, help="round-robin timed repeats.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write candidates and the choice here.")
@click.option("--no-cache", is_flag=True, help="measure again even if this choice is cached.")
@click.option("--model-from", type=click.Path(exists=True, dir_okay=False),
              help="a --json of another configuration (e.g. one node): also predict this run from its machine model "
                   "and report that error.")
def tune_cmd(target: str, ranks: int, nodes: int, repeats: int, json_path: str | None, no_cache: bool,
             model_from: str | None) -> None:
    """Choose the schedule of TARGET (FILE.py, or adam, lamb, sgd, megatron, bmuf) by timing every legal one;
    `one-shot` measures the shared-memory all_reduce's one-shot threshold instead, `kernel-bytes` the fused
    collective's bytes per kernel call, `eager-work` the size below which generated kernels run eagerly, and saves
    it for the runtime.

    The candidates are CoCoNeT's directive chains (split, reorder, as_slice, fuse, overlap by 2/4/8 chunks), each
    checked against the reference interpreter on small inputs, then timed round-robin on the ranks; the cost model's
    prediction is printed next to each measurement. The choice is cached per program, ranks, torch and machine."""
    from cocosync.bench.common import print_table, write_json
    from cocosync.tune.tuner import autotune

    if target == "one-shot":
        return _one_shot(ranks, repeats, json_path)
    if target == "kernel-bytes":
        return _kernel_bytes(ranks, repeats, json_path)
    if target == "eager-work":
        return _eager_work(ranks, repeats, json_path)
    try:
        if ranks % nodes:
            raise click.BadParameter(f"{nodes} does not divide --ranks {ranks}", param_hint="--nodes")
        other = None
        if model_from:
            import json
            from pathlib import Path

            try:
                other = json.loads(Path(model_from).read_text())["model"]
            except (ValueError, KeyError, TypeError):
                raise click.BadParameter(f"{model_from} is not a `cocosync tune --json` file (no 'model')",
                                         param_hint="--model-from") from None
        result = autotune(target, world=ranks, nodes=nodes, repeats=repeats, use_cache=not no_cache,
                          model_from=other)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="TARGET") from None
    rows = []
    cross = "cross_error" in result.extra
    for c in result.candidates:
        ms = lambda k: f"{c[k] * 1e3:.3f} ms" if k in c else "-"  # noqa: E731
        err = lambda k: (f"{(c[k] - c['measured_s']) / c['measured_s']:+.0%}" if "measured_s" in c else  # noqa: E731
                         c.get("pruned", "-"))
        rows.append([("* " if c["name"] == result.chosen else "  ") + c["name"], ms("measured_s"), ms("predicted_s"),
                     err("predicted_s"), *([ms("predicted_from_s"), err("predicted_from_s")] if cross else [])])
    error = f"{result.model_error:.0%}" if result.model_error is not None else "-"
    nodes = result.extra.get("nodes", 1)
    caption = f"chosen: {result.chosen} -- {result.reason}; cost model median error {error}"
    if cross and result.extra["cross_error"] is not None:
        m = result.extra["model_from"]
        caption += (f"; predicted from the model measured on {m['world']} ranks / {m['nodes']} node(s): median "
                    f"error {result.extra['cross_error']:.0%}")
    print_table(f"tune {result.workload} on {result.world} ranks" + (f", {nodes} nodes" if nodes > 1 else "")
                + (" (cached)" if result.cached else ""),
                ["schedule", "measured (median)", "predicted", "prediction error",
                 *(["predicted from --model-from", "its error"] if cross else [])], rows, caption=caption)
    _print_projection(result)
    if json_path:
        write_json(json_path, result.as_json())


def _print_projection(result) -> None:
    from cocosync.bench.common import print_table

    rows = []
    for p in result.extra.get("projection", []):
        pred = p["predicted_s"]
        rows.append([str(p["nodes"]), str(p["world"]), p["best"], f"{pred[p['best']] * 1e3:.3f} ms",
                     f"{pred.get(result.chosen, float('nan')) * 1e3:.3f} ms",
                     f"{pred.get('as written', float('nan')) * 1e3:.3f} ms"])
    if rows:
        print_table("cost model projection (same ranks per node; the network as measured here)",
                    ["nodes", "ranks", "predicted best", "its time", f"chosen ({result.chosen})", "as written"], rows)


def _measured_constant(name: str, ranks: int, measure: Any, repeats: int, choose: Any,
                       json_path: str | None) -> tuple[dict, int, str]:
    """Run `measure(repeats)` on `ranks` local ranks, choose the constant from rank 0's rows, save it (and the rows
    to `json_path`); returns (rows, chosen, the constants file)."""
    from cocosync.bench.common import write_json
    from cocosync.testing.launch import RankPool
    from cocosync.tune.constants import save_constant

    with RankPool(ranks, threads=1, timeout=1800) as pool:
        out = pool.run(measure, repeats)[0]
    chosen = choose(out)
    path = save_constant(name, out["local_ranks"], chosen)
    if json_path:
        write_json(json_path, {"constant": name, "chosen": chosen, **out})
    return out, chosen, path


def _one_shot(ranks: int, repeats: int, json_path: str | None) -> None:
    from cocosync.bench.common import fmt_bytes, print_table
    from cocosync.runtime.comm.collectives import DEFAULT_ONE_SHOT_BYTES
    from cocosync.tune.constants import choose_one_shot, measure_one_shot

    out, chosen, path = _measured_constant("one_shot_bytes", ranks, measure_one_shot, max(repeats, 15),
                                           lambda o: choose_one_shot(o["rows"]), json_path)
    rows = [[fmt_bytes(r["peer_bytes"]), f"{r['one_shot_s'] * 1e6:.1f} us", f"{r['three_phase_s'] * 1e6:.1f} us",
             f"{r['three_phase_s'] / r['one_shot_s']:.2f}x"] for r in out["rows"]]
    print_table(f"one-shot vs three-phase all_reduce on {out['local_ranks']} local ranks",
                ["(ranks - 1) x bytes", "one-shot", "three-phase", "three-phase / one-shot"], rows,
                caption=f"one_shot_bytes = {chosen} ({fmt_bytes(chosen)}; hand-tuned default "
                        f"{fmt_bytes(DEFAULT_ONE_SHOT_BYTES)}) saved to {path}")


def _kernel_bytes(ranks: int, repeats: int, json_path: str | None) -> None:
    from cocosync.bench.common import fmt_bytes, print_table
    from cocosync.runtime.steps.common import DEFAULT_KERNEL_BYTES
    from cocosync.tune.constants import choose_kernel_bytes, measure_kernel_bytes

    out, chosen, path = _measured_constant("kernel_bytes", ranks, measure_kernel_bytes, max(repeats, 9),
                                           lambda o: choose_kernel_bytes(o["rows"], DEFAULT_KERNEL_BYTES), json_path)
    best = next(r for r in out["rows"] if r["kernel_bytes"] == chosen)
    default = next(r for r in out["rows"] if r["kernel_bytes"] == DEFAULT_KERNEL_BYTES)
    rows = [[("* " if r is best else "  ") + fmt_bytes(r["kernel_bytes"]), f"{r['median_s'] * 1e3:.2f} ms",
             f"{default['median_s'] / r['median_s']:.2f}x"] for r in out["rows"]]
    print_table(f"fused Adam step ({fmt_bytes(out['numel'] * 4)} fp32) by bytes per kernel call, "
                f"{out['local_ranks']} local ranks", ["kernel bytes", "median (slowest rank)", "vs default"], rows,
                caption=f"kernel_bytes = {chosen} ({fmt_bytes(chosen)}; hand-tuned default "
                        f"{fmt_bytes(DEFAULT_KERNEL_BYTES)}, kept unless another is > 5% faster) saved to {path}")


def _eager_work(ranks: int, repeats: int, json_path: str | None) -> None:
    from cocosync.bench.common import print_table
    from cocosync.runtime.steps.codegen import EAGER_WORK
    from cocosync.tune.constants import choose_eager_work, measure_eager_work

    out, chosen, path = _measured_constant("eager_work", ranks, measure_eager_work, max(repeats, 9),
                                           lambda o: choose_eager_work(o["rows"], o["stages"]), json_path)
    rows = [[("* " if r["numel"] * out["stages"] == chosen else "  ") + f"{r['numel'] // 1024}K",
             f"{r['compiled_s'] * 1e6:.1f} us", f"{r['eager_s'] * 1e6:.1f} us",
             f"{r['eager_s'] / r['compiled_s']:.2f}x"] for r in out["rows"]]
    print_table(f"epilogue kernel ({out['stages']} stages) compiled vs eager, {out['local_ranks']} local ranks",
                ["elements", "compiled (slowest rank)", "eager", "eager / compiled"], rows,
                caption=f"eager_work = {chosen} elements x stages (kernels below it run eagerly; hand-tuned default "
                        f"{EAGER_WORK}) saved to {path}")
