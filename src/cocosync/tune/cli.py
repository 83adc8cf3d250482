"""`cocosync tune FILE.py|adam|lamb|sgd|megatron|bmuf [--ranks P] [--json PATH]`: the tuner's table and choice."""

from __future__ import annotations

import click


@click.command("tune")
@click.argument("target")
@click.option("--ranks", type=click.IntRange(2, 64), default=2, show_default=True, help="local ranks to time on.")
@click.option("--repeats", type=click.IntRange(1), default=7, show_default=True, help="round-robin timed repeats.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="write candidates and the choice here.")
@click.option("--no-cache", is_flag=True, help="measure again even if this choice is cached.")
def tune_cmd(target: str, ranks: int, repeats: int, json_path: str | None, no_cache: bool) -> None:
    """Choose the schedule of TARGET (FILE.py, or adam, lamb, sgd, megatron, bmuf) by timing every legal one;
    `one-shot` measures the shared-memory all_reduce's one-shot threshold instead and saves it for the runtime.

    The candidates are CoCoNeT's directive chains (split, reorder, as_slice, fuse, overlap by 2/4/8 chunks), each
    checked against the reference interpreter on small inputs, then timed round-robin on the ranks; the cost model's
    prediction is printed next to each measurement. The choice is cached per program, ranks, torch and machine."""
    from cocosync.bench.common import print_table, write_json
    from cocosync.tune.tuner import autotune

    if target == "one-shot":
        return _one_shot(ranks, repeats, json_path)
    try:
        result = autotune(target, world=ranks, repeats=repeats, use_cache=not no_cache)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="TARGET") from None
    rows = []
    for c in result.candidates:
        ms = lambda k: f"{c[k] * 1e3:.3f} ms" if k in c else "-"  # noqa: E731
        err = (f"{(c['predicted_s'] - c['measured_s']) / c['measured_s']:+.0%}" if "measured_s" in c else
               c.get("pruned", "-"))
        rows.append([("* " if c["name"] == result.chosen else "  ") + c["name"], ms("measured_s"), ms("predicted_s"),
                     err])
    error = f"{result.model_error:.0%}" if result.model_error is not None else "-"
    print_table(f"tune {result.workload} on {result.world} ranks" + (" (cached)" if result.cached else ""),
                ["schedule", "measured (median)", "predicted", "prediction error"], rows,
                caption=f"chosen: {result.chosen} -- {result.reason}; cost model median error {error}")
    if json_path:
        write_json(json_path, result.as_json())


def _one_shot(ranks: int, repeats: int, json_path: str | None) -> None:
    from cocosync.bench.common import fmt_bytes, print_table, write_json
    from cocosync.runtime.comm.collectives import DEFAULT_ONE_SHOT_BYTES
    from cocosync.testing.launch import RankPool
    from cocosync.tune.constants import choose_one_shot, measure_one_shot, save_constant

    with RankPool(ranks, threads=1, timeout=1800) as pool:
        out = pool.run(measure_one_shot, max(repeats, 15))[0]
    chosen = choose_one_shot(out["rows"])
    path = save_constant("one_shot_bytes", out["local_ranks"], chosen)
    rows = [[fmt_bytes(r["peer_bytes"]), f"{r['one_shot_s'] * 1e6:.1f} us", f"{r['three_phase_s'] * 1e6:.1f} us",
             f"{r['three_phase_s'] / r['one_shot_s']:.2f}x"] for r in out["rows"]]
    print_table(f"one-shot vs three-phase all_reduce on {out['local_ranks']} local ranks",
                ["(ranks - 1) x bytes", "one-shot", "three-phase", "three-phase / one-shot"], rows,
                caption=f"one_shot_bytes = {chosen} ({fmt_bytes(chosen)}; hand-tuned default "
                        f"{fmt_bytes(DEFAULT_ONE_SHOT_BYTES)}) saved to {path}")
    if json_path:
        write_json(json_path, {"constant": "one_shot_bytes", "chosen": chosen, **out})
