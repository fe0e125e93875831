"""Where a pipelined decode step's link sits idle, from saved profiler traces (``bench_offload.py --sections
attnprofile`` writes them under ``OUT/traces``): per trace, the time with no plane transfer running split by
category and by kernel, and the median long gap between transfers (a layer boundary) kernel by kernel.

    python scripts/trace_gaps.py --out results/tail_h200 --steps 3 LABEL=TRACE.json.gz ...

writes ``OUT.json`` and ``OUT.md``. Reads traces only: no GPU needed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def analyse(events: list[dict], steps: int, top: int = 20) -> dict:
    idle = harness.idle_breakdown(events, steps, top_kernels=top)
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3
    return {"span_ms_per_step": span / steps,
            "transfer_running_ms_per_step": idle["exposed_ms_per_step"]["transfer_running"],
            "outside_transfers_ms_per_step": idle["exposed_ms_per_step"]["outside_transfers"],
            "exposed_kernels_ms_per_step": idle["exposed_kernels_ms_per_step"], "median_gap": idle["median_gap"]}


def report(res: dict) -> str:
    lines = ["# Where the link sits idle in the pipelined step", "", res["note"], ""]
    for label, r in res["traces"].items():
        gap = r["median_gap"]
        lines += [f"## {label}", "",
                  f"Span {r['span_ms_per_step']:.1f} ms per step; a plane transfer running "
                  f"{r['transfer_running_ms_per_step']:.1f} ms; none running: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["outside_transfers_ms_per_step"].items()) + " ms.", "",
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
