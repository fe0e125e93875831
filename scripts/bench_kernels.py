"""Kernel benchmarks on the GPU: writes results/kernels_h200.{json,md,png}.

Every timing runs the kernel ``iters`` times inside one jitted ``lax.fori_loop`` (each iteration
depends on the last through a negligible perturbation of an input, so nothing is hoisted or elided)
and divides; ``repeats`` such loops give the median and the spread (min, max). A single jitted call
costs ~0.1 ms to dispatch, more than a scan at 32k, so per-call timing would measure dispatch.

    python3 -m scripts.bench_kernels --out results            # the scans (the default --sections)
    python3 -m scripts.bench_kernels --sections scan --tune    # scan tile / warp sweep
    python3 -m scripts.bench_kernels --sections scan --budgets 48 --no-nibble   # Fathom 48 alone
    python3 -m scripts.bench_kernels --preset topk-tune --out $OUT   # the run behind a committed table (PRESETS)

This module holds the command line, its presets and the sections driver; ``kernel_compute`` the HBM-resident kernels
(scans, top-k), ``kernel_transfers`` the reads from host memory (run gather, row fetch), ``kernel_report`` the report.
"""

from __future__ import annotations

import argparse
import os
import sys

from scripts import harness
from scripts import kernel_compute as compute
from scripts import kernel_transfers as transfers
from scripts.kernel_report import write_report

# `--preset NAME`: the argument list of the run behind a committed table (results/README.md); arguments after it win.
PRESETS = harness.presets({
    "kernels": "--sections scan,topk,gather,rowfetch --name kernels_h200",  # its command was not recorded: its sections
    "topk-tune": "--sections topk --tune --name topk_tune_h200",
    "gather-tune": "--sections gather --tune --name gather_tune_h200",
    "rowfetch": "--sections rowfetch --tune --rowfetch-sizes 131072,1048576 --name rowfetch_h200",
    "rowfetch-fresh": "--sections rowfetch --rowfetch-sizes 131072,1048576 --name rowfetch_fresh_h200",
    "rowlayout": "--sections rowlayout --rowfetch-sizes 131072,1048576 --name rowlayout_h200",
    "topk-split-roworder": "--sections topksplit,roworder --name kernels_u2_h200",
})
SECTIONS = ("scan", "scanchunk", "topk", "topksplit", "gather", "rowfetch", "roworder", "rowlayout")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--sections", default="scan")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--sizes", default="32768,131072")
    ap.add_argument("--budgets", default="32,48,64", help="Fathom budgets of the scan section")
    ap.add_argument("--no-nibble", action="store_true", help="the scan section without the nibble scans")
    ap.add_argument("--rowfetch-sizes", default="131072", help="context sizes of the row-fetch section")
    ap.add_argument("--name", default="kernels_h200", help="results file name (without extension)")
    ap.add_argument("--chunks", default="", help="groups x tokens of the scanchunk section's chunks, e.g. "
                                                 "1x1048576,4x131072 (default: SCAN_CHUNKS)")
    return ap


def scan_section(res, args, save) -> None:
    """The scans at each of ``--sizes``, after a check of the kernels against their references on this GPU; the results
    saved after each size."""
    res["scan_check"] = compute.check_scans()
    print("check", res["scan_check"], flush=True)
    res["scan"] = []
    res["plan_active_channels"] = {}
    budgets = tuple(map(int, args.budgets.split(",")))
    for n in map(int, args.sizes.split(",")):
        rows, active = compute.scan_cases(n, tune=args.tune, budgets=budgets, nibble=not args.no_nibble)
        for r in rows:
            r["floor_ms"] = r["bytes"] / (res["copy"]["GBps"] * 1e9) * 1e3  # its bytes at the HBM copy rate
            print(f"{r['kernel']:22s} n={n:7d} {r['variant']:6s} lanes={r['lanes']:2d} tile={r['tile']:5d} "
                  f"w={r['num_warps']} {r['median_ms']:.4f} ms [{r['min_ms']:.4f},{r['max_ms']:.4f}] "
                  f"{r['GBps']:.0f} GB/s floor {r['floor_ms']:.4f} ms authors {r['authors_ms']}", flush=True)
        res["scan"] += rows
        res["plan_active_channels"][n] = active
        save()


def main(argv=None):
    ap = parser()
    args = ap.parse_args(harness.expand_preset(sys.argv[1:] if argv is None else argv, PRESETS))
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    machine = harness.machine()
    res = {"machine": machine, "command": harness.command("scripts.bench_kernels", argv), "jax": machine["jax"],
           "date": machine["date"], "copy": harness.hbm_copy_rate()}
    print("copy", res["copy"], flush=True)
    os.makedirs(args.out, exist_ok=True)

    def save():  # after every section, so a run stopped at its time limit keeps what it measured
        harness.write_json(os.path.join(args.out, f"{args.name}.json"), res)
        write_report(res, args.out, args.name)

    if "scan" in sections:
        scan_section(res, args, save)
    save()
    sizes = tuple(map(int, args.rowfetch_sizes.split(",")))
    later = {  # section: (its key in the results, what measures it), in the order they run
        "scanchunk": ("scan_chunk", lambda: compute.scan_chunk_cases(
            compute.parse_chunks(args.chunks) if args.chunks else compute.SCAN_CHUNKS)),
        "topk": ("topk", lambda: compute.topk_cases(tune=args.tune)),
        "topksplit": ("topk_split", compute.topk_split_cases),
        "gather": ("gather", lambda: transfers.gather_cases(tune=args.tune)),
        "rowfetch": ("row_fetch", lambda: transfers.rowfetch_cases(
            sizes, transfers.ROWFETCH_CONFIGS if args.tune else transfers.ROWFETCH_CONFIGS[:1])),
        "roworder": ("row_order", transfers.roworder_cases),
        "rowlayout": ("row_layout", lambda: transfers.rowlayout_cases(sizes)),
    }
    for section, (key, measure) in later.items():
        if section in sections:
            res[key] = measure()
            save()


if __name__ == "__main__":
    main()
