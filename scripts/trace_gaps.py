"""Where a pipelined decode step's link sits idle, from saved profiler traces (``bench_offload.py --sections
attnprofile`` writes them under ``OUT/traces``): per trace, the time with no plane transfer running split by
category and by kernel, and the median long gap between transfers (a layer boundary) kernel by kernel.

    python -m scripts.trace_gaps --out results/tail_h200 --steps 3 LABEL=TRACE.json.gz ...

writes ``OUT.json`` and ``OUT.md``. Reads traces only: no GPU needed.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from scripts import harness


def layer_phases(events: list[dict]) -> dict:
    """Median microseconds of a pipelined layer's three phases, layer by layer: ``transfers`` (its first chunk's plane
    transfer starts -> its last one ends), ``tail`` (-> its last row fetch ends: the last chunks' scan, selection and
    fetch) and ``boundary`` (-> the next layer's first transfer starts: attention, writes, the next plan). A layer
    starts at its first chunk's transfer kernel, the one whose name has no ``__N`` suffix."""
    def is_(category):
        return lambda e: harness.categorize(e.get("name", "")) == category

    transfers = sorted(filter(is_(harness.TRANSFER), events), key=lambda e: e["ts"])
    fetches = sorted(filter(is_("row fetch"), events), key=lambda e: e["ts"] + e["dur"])
    starts = [e["ts"] for e in transfers if "__" not in e.get("name", "")]
    phases: dict[str, list[float]] = {"transfers": [], "tail": [], "boundary": []}
    for a, b in zip(starts, starts[1:]):
        moved = [e["ts"] + e["dur"] for e in transfers if a <= e["ts"] < b]
        fetched = [e["ts"] + e["dur"] for e in fetches if a <= e["ts"] < b]
        if not moved or not fetched:
            continue
        last_transfer, last_fetch = max(moved), max(fetched)
        phases["transfers"].append(last_transfer - a)
        phases["tail"].append(last_fetch - last_transfer)
        phases["boundary"].append(b - last_fetch)
    out = {k: round(float(np.median(v)), 1) for k, v in phases.items() if v}
    return out | {"layers": len(phases["transfers"])} if out else {}


def analyse(events: list[dict], steps: int, top: int = 20) -> dict:
    idle = harness.idle_breakdown(events, steps, top_kernels=top)
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    return {"span_ms_per_step": span / steps,
            "transfer_running_ms_per_step": idle["exposed_ms_per_step"]["transfer_running"],
            "outside_transfers_ms_per_step": idle["exposed_ms_per_step"]["outside_transfers"],
            "layer_phases_us": layer_phases(events),
            "exposed_kernels_ms_per_step": idle["exposed_kernels_ms_per_step"], "median_gap": idle["median_gap"]}


def report(res: dict) -> str:
    lines = ["# Where the link sits idle in the pipelined step", "", res["note"], ""]
    for label, r in res["traces"].items():
        gap = r["median_gap"]
        lines += [f"## {label}", "",
                  f"Span {r['span_ms_per_step']:.1f} ms per step; a plane transfer running "
                  f"{r['transfer_running_ms_per_step']:.1f} ms; none running: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["outside_transfers_ms_per_step"].items()) + " ms.", "",
                  *_phase_lines(r.get("layer_phases_us")),
                  "| kernel (none of the plane transfers running) | ms per step |", "|---|---|"]
        lines += [f"| `{k}` | {v:.3f} |" for k, v in r["exposed_kernels_ms_per_step"].items()]
        if gap:
            lines += ["", f"The median ({gap['median_us']:.0f} us) of the {gap['gaps']} gaps of over 20 us between "
                          f"plane transfers ({gap['total_ms'] / res['steps']:.1f} ms per step), kernel by kernel (us from "
                          "its start; kernels that began before it start below 0):", "",
                      "| start | end | kernel | category |", "|---|---|---|---|"]
            lines += [f"| {k['start_us']:.1f} | {k['end_us']:.1f} | `{k['name']}` | {k['category']} |"
                      for k in gap["kernels"]]
        lines.append("")
    return "\n".join(lines)


def _phase_lines(phases: dict | None) -> list[str]:
    if not phases:
        return []
    total = phases["transfers"] + phases["tail"] + phases["boundary"]
    return [f"A layer (median of {phases['layers']}): its plane transfers {phases['transfers']:.0f} us, then its "
            f"last chunks' scan, selection and row fetch {phases['tail']:.0f} us, then attention, writes and the next "
            f"plan {phases['boundary']:.0f} us ({total:.0f} us in all).", ""]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="LABEL=PATH (a perfetto .json.gz trace)")
    ap.add_argument("--out", required=True, help="output prefix (.json and .md are added)")
    ap.add_argument("--steps", type=int, default=3, help="steps the trace holds (harness.profile_breakdown: 3)")
    ap.add_argument("--note", default="", help="a sentence on where the traces come from")
    args = ap.parse_args(argv)
    res = {"note": args.note, "steps": args.steps, "traces": {}}
    for item in args.traces:
        label, _, path = item.rpartition("=")
        events = harness.device_events(harness.read_trace(path))
        res["traces"][label or os.path.basename(path)] = analyse(events, args.steps)
    harness.write_json(args.out + ".json", res)
    with open(args.out + ".md", "w") as f:
        f.write(report(res))
    print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
    main()
