"""The kernel benchmark's report: ``NAME.md`` (a table per section measured) and ``NAME.png`` (the scans against the
authors' kernels) from its results."""

from __future__ import annotations

import os

import numpy as np

from scripts.kernel_compute import AUTHORS


def _section(title, notes, columns, rows):
    """A report section: ``## title``, each note as a paragraph, then a markdown table of ``columns`` over ``rows``
    (one list of cells per row)."""
    lines = [f"## {title}", ""]
    for note in notes:
        lines += [note, ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(map(str, cells)) + " |" for cells in rows] + [""]


def _ms(r):
    """The median and [min, max] cells of a timing."""
    return [f"{r['median_ms']:.4f}", f"[{r['min_ms']:.4f}, {r['max_ms']:.4f}]"]


def _topk_vs_f32(r) -> str:
    if "topk_differ" not in r:
        return ""
    return f"{r['topk_differ']} ({r['topk_differ_near_ties']}) / {r['topk_rows']} x {r['topk_k']}"


def write_report(res, out, name="kernels_h200"):
    L = [f"# Kernel benchmarks ({res['machine']['device']})", "",
         f"JAX {res['jax']}, {res['date']}. Median of repeats of a jitted fori_loop (ms per call), [min, max].",
         f"HBM copy rate (read+write, 1 GiB): {res['copy']['GBps']:.0f} GB/s.", ""]
    if "scan" in res:
        L += _section(
            "Scans (HBM-resident, batch 4 x 8 KV heads, G=4, D=128)",
            [f"Correctness on the GPU: {res['scan_check']}; mean active channels per plan: {res['plan_active_channels']}.",
             "lanes: consecutive tokens a thread owns in the plane scan (8, 16 or 32; 0 in rows of the nibble scans and in "
             "rows of the blocked kernel, since removed, in older results). variant: `lanes` (CUDA-core f32 FMAs), `f16x2` "
             "(pairs of tokens in packed f16 FMAs), `nibble`, or, in older results, `mma` / `mgpu` (tensor-core products, "
             "since deleted: measured slower; rows: their product rows per K step). HBM floor: the row's bytes (reads + "
             "f32 scores) at the HBM copy rate above. top-k vs f32 (f16x2 rows): of the rows' top-512 sets under the "
             "first (f32) row's scores, the tokens the f16x2 scores select differently, and how many of them are near-ties "
             "(within twice the f16x2 error bound of the k-th score); err / bound: the largest |score - f32 score| over "
             "its bound.",
             *sorted({f"Failed ({r['variant']}, tile {r['tile']}, rows {r['rows']}, warps {r['num_warps']}): "
                      f"{r['error']}" for r in res["scan"] if "error" in r})],
            ["kernel", "n", "variant", "lanes", "rows", "tile", "warps", "ms (median)", "[min, max]",
             "GB/s (reads + f32 scores)", "HBM floor ms", "authors' ms", "top-k vs f32: differ (near-ties) / rows x k",
             "err / bound"],
            ([r["kernel"], r["n"], r.get("variant", "lanes" if r.get("lanes") else ""), r.get("lanes", 0),
              r.get("rows", 0), r["tile"], r["num_warps"], *_ms(r), f"{r['GBps']:.0f}",
              f"{r['bytes'] / (res['copy']['GBps'] * 1e9) * 1e3:.4f}", r["authors_ms"], _topk_vs_f32(r),
              f"{r['max_err_over_bound']:.3f}" if "max_err_over_bound" in r else ""] for r in res["scan"]))
    if "scan_chunk" in res:
        L += _section(
            "Scan of one pipelined chunk (Fathom 48, staged planes of the chunk's groups, HBM-resident, G=4, D=128)",
            ["The chunk scans of the decode step: 1 group of 1M tokens (batch 1 in 8 chunks), 4 and 32 groups of 128k "
             "(batch 1 and 8 in 2 chunks). `same bits`: scores equal to the first configuration's bit for bit."],
            ["groups", "n", "variant", "tile", "lanes", "warps", "us (median)", "[min, max]", "same bits",
             "top-k vs f32: differ (near-ties) / rows x k"],
            ([r["groups"], r["n"], r.get("variant", "lanes"), r["tile"], r["lanes"], r["num_warps"],
              f"{r['median_ms'] * 1e3:.1f}", f"[{r['min_ms'] * 1e3:.1f}, {r['max_ms'] * 1e3:.1f}]", r["same_bits"],
              _topk_vs_f32(r)] for r in res["scan_chunk"]))
    if "gather" in res:
        L += _section(
            "Run gather vs run size (8 KV heads x 128 channels x 4 planes)", [],
            ["kernel", "source", "run bytes", "chunk, warps", "total MB", "ms", "GB/s"],
            ([r["kernel"], r["source"], r["run_bytes"], f"{r['chunk']}, {r['num_warps']}" if "chunk" in r else "",
              f"{r['bytes']/1e6:.1f}", f"{r['median_ms']:.3f}", f"{r['GBps']:.1f}"] for r in res["gather"]))
    if "topk" in res:
        L += _section(
            "Top-k (4 sink + 32 local + top-476), [32, n], k = 512", [],
            ["method", "n", "ms", "[min, max]", "same set as reference"],
            ([r["kernel"], r["n"], *_ms(r), r["same_set_as_reference"]] for r in res["topk"]))
    if "topk_split" in res:
        L += _section(
            "Top-k with split rows (fused path; k = 512; a decode cache's rows, length n - 63)",
            ["`buckets / P`: each row's bucket selection over P programs, then one merging their survivors; "
             "`tokens / P` likewise for the token selection among the candidate buckets (1: one program per row)."],
            ["n", "rows", "buckets / P", "tokens / P", "ms", "[min, max]", "same set as reference"],
            ([r["n"], r["rows"], r["bucket_splits"], r["token_splits"], *_ms(r), r["same_set_as_reference"]]
             for r in res["topk_split"]))
    if "row_fetch" in res:
        L += _section(
            "Row fetch (2048 rows x 8 KV heads, K and V, bf16, Dh = 128)",
            ["rows: `repeated` = every timed call fetches the same rows; `fresh` = each call its own random set."],
            ["source", "n", "pattern", "rows", "rows/program", "warps", "ms", "GB/s", "rows/s", "exact"],
            ([r["source"], r.get("n", 131072), r.get("pattern", "random"), r.get("rowset", "repeated"), r.get("rows", 32),
              r.get("num_warps", 4), f"{r['median_ms']:.4f}", f"{r['GBps']:.1f}", f"{r['rows_per_s']:.3g}", r["exact"]]
             for r in res["row_fetch"]))
    if "row_layout" in res:
        L += _section(
            "Row fetch layout (2048 fresh rows per call x 8 KV heads, K and V, bf16, Dh = 128, from pinned_host)",
            ["`split`: K and V as two arrays (two 256-byte runs per token); `interleaved`: one `[n, 2 Dh]` array "
             "(one 512-byte run per token)."],
            ["layout", "n", "ms", "[min, max]", "GB/s", "exact"],
            ([r["layout"], r["n"], *_ms(r), f"{r['GBps']:.1f}", r["exact"]] for r in res["row_layout"]))
    if "row_order" in res:
        L += _section(
            "Row fetch order (2048 fresh rows per call per group, one 512-byte K/V run each, from pinned_host)",
            ["`programs` 0: one program per 32 rows (every group's rows in flight at once); N: N persistent programs "
             "walking the rows group by group."],
            ["groups", "n", "K/V GiB", "programs", "ms", "[min, max]", "GB/s", "exact"],
            ([r["groups"], r["n"], f"{r['groups'] * r['n'] * 512 / 2**30:.1f}", r["programs"], *_ms(r),
              f"{r['GBps']:.1f}", r["exact"]] for r in res["row_order"]))
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(L))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = ["sparq_r16", "nibble_32", "full_4bit", "fathom_48", "fathom_64"]
    if not any(r["kernel"] in names and np.isfinite(r["median_ms"]) for r in res.get("scan", ())):
        return  # nothing to plot yet (a run saved after the gathered rows only, or failed kernels only)
    fig, ax = plt.subplots(figsize=(8, 4))
    ns = sorted({r["n"] for r in res["scan"]})
    for i, n in enumerate(ns):
        ours = [np.nanmin([r["median_ms"] for r in res["scan"] if r["kernel"] == k and r["n"] == n] or [np.nan])
                for k in names]  # a failed configuration's NaN row never wins
        theirs = [AUTHORS.get(n, {}).get(k, np.nan) for k in names]
        x = np.arange(len(names)) + i * 0.4
        ax.bar(x, ours, 0.2, label=f"ours n={n}")
        ax.bar(x + 0.2, theirs, 0.2, label=f"authors n={n}", alpha=0.6)
    ax.set_xticks(np.arange(len(names)) + 0.3)
    ax.set_xticklabels(names)
    ax.set_ylabel("ms per layer")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=100)
