"""The offload benchmark's report (``scripts/bench_offload.py``): ``--merge`` (one results file from several runs,
the newest run of each measurement winning), and the markdown and plots of a results file: the attention-only and
full-step tables, one GPU against a mesh, K/V row formats, the row cache, resident planes, profiles, prefill and
errors; the step time against context, against the index's HBM bytes (resident planes) and against the batch."""

from __future__ import annotations

import math

from scripts import harness
from scripts.offload_inputs import inputs_lines
from scripts.offload_setup import AUTHORS_MS


# What a row measured before an option existed ran: its fields as today's rows record them. Before 2026-12-01 every
# layer's writes came after the scan; the GPU streams, writes after the scan, the two-kernel selection, the chained
# chunk order and the threshold selection (``select``) are measured options since deleted, kept for their rows.
OLD_ROW_FIELDS = {"streams": 1, "index_writes": "every_step", "pipeline": 1, "gather_programs": 0, "scan_writes": False,
                  "fetch_programs": 0, "topk": "single", "xla_options": "", "layer_unroll": 1, "row_cache": 0,
                  "resident_planes": 0, "warm_planes": 0, "rows": "model", "inputs": "today", "selection": "topk_union",
                  "order": "xla", "scan": "default", "select": "sorted", "attention": "xla"}

# The attention-only table's title, notes and columns.
ATTENTION_HEAD = ["## Attention-only step (36 layers; ms per step, median [min, max])", "",
                  "read: `direct` = the plane scan reads host memory as it computes; `staged` = the run gather copies the "
                  "planned runs to HBM first. Link floor: every byte of the planned planes + scales and of the selected "
                  "rows over the link once at the rate measured in the run.", "",
                  "`index writes`: `every_step` writes the newest plane block of every layer each step; `full_blocks` only "
                  "when it fills (once in 64 steps: its cost, the cache write's plane words in the profile, is then "
                  "spread over 64 steps and the median leaves it out); `in scan`: each layer writes its new K/V row and "
                  "blocks inside the layer scan, beside its own transfers (the default since 2026-12-01), instead of every "
                  "layer's after the scan (an option since deleted: measured slower).", "",
                  "`split`: a layer's groups on several GPU streams (an option since deleted: measured slower), or in "
                  "pipelined chunks whose plane transfers are "
                  "chained (the next chunk's transfer beside this chunk's scan, selection and row fetch), with the run "
                  "gather as that many persistent programs; `selection fused` (a group's selection and union in two "
                  "kernels, no sort) and `order chained` (each chunk's scan waiting for the previous chunk's rows): "
                  "options since deleted: measured slower.", "",
                  "| method | context | batch | mesh | split | index writes | memory | read | shared K/V | bits/token | scan MB | rows MB (max) | ms | "
                  "link floor ms | fraction of link | authors' ms | run |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

# The full-step table's title, notes and columns.
FULL_HEAD = ["## Full decode step (QKV, sparse attention, o_proj, MLP, lm_head)", "",
             "`weight GEMMs`: `copied` = Triton GEMMs on copies of each layer's weights sliced out of the stacked "
             "arrays (before 2026-12-01); `in place` = cuBLAS GEMMs reading the slices in place (XLA's dynamic-slice "
             "fusion, `models.generation.WEIGHT_GEMM_OPTIONS`).", "",
             "| method | context | batch | mesh | split | index writes | weight GEMMs | ms | tokens/s | wall / device |",
             "|---|---|---|---|---|---|---|---|---|---|"]


def migrate(row: dict, config: dict | None = None) -> dict:
    """An old results row upgraded to today's fields (a new dict; a row of today's runs comes back equal): every
    option it predates set to what it ran (:data:`OLD_ROW_FIELDS`), a full step's weight GEMMs ``copied`` (before
    2026-12-01), its read mode from its run's ``config`` where the row recorded none, and its profile's first name of
    the plane scan's category renamed. Every reader of results rows (the report, ``--merge``) reads them through this."""
    out = OLD_ROW_FIELDS | row
    if out.get("kind") == "full":
        out.setdefault("weight_gemms", "copied")
    if config is not None and "read" not in out:
        out["read"] = config.get("read")
    prof = out.get("profile", {}).get("ms_per_step", {})
    if "scan (reads host planes)" in prof:  # the category's first name; staged runs' scan reads HBM
        prof = dict(prof)
        prof["plane scan kernel"] = prof.pop("scan (reads host planes)")
        out["profile"] = out["profile"] | {"ms_per_step": prof}
    return out


def writes_text(r: dict) -> str:
    """A row's index writes, and ``in scan`` where each layer wrote inside the layer scan."""
    r = migrate(r)
    return r["index_writes"] + (" in scan" if r["scan_writes"] else "")


def split_text(r: dict) -> str:
    """How a row's layer was split: ``""`` (one chunk), ``streams 2``, ``pipeline 8 (gather 132)``, and the kernels'
    options that differ from the earlier runs' (``fetch 66``: persistent row-fetch programs; ``top-k split``: each
    row's selections over several programs; ``xla: ...``: extra XLA options)."""
    r = migrate(r)
    if r["streams"] > 1:
        text = f"streams {r['streams']}"
    elif r["pipeline"] > 1:
        programs = r["gather_programs"]
        text = f"pipeline {r['pipeline']}" + (f" (gather {programs})" if programs else "")
    else:
        text = f"gather {r['gather_programs']}" if r["gather_programs"] else ""
    extra = ([f"rows {r['rows']}"] if r["rows"] != "model" else []) + \
            ([f"resident planes {r['resident_planes']}"] if r["resident_planes"] else []) + \
            ([f"warm planes {r['warm_planes']}"] if r["warm_planes"] else []) + \
            ([f"fetch {r['fetch_programs']}"] if r["fetch_programs"] else []) + \
            (["top-k split"] if r["topk"] != "single" else []) + \
            ([f"scan {r['scan']}"] if r["scan"] != "default" else []) + \
            ([f"{r['layer_unroll']} layers per loop iteration"] if r["layer_unroll"] > 1 else []) + \
            ([f"row cache {r['row_cache']} slots"] if r["row_cache"] else []) + \
            ([f"{r['inputs']} inputs"] if r["inputs"] != "today" else []) + \
            ([f"xla: {r['xla_options']}"] if r["xla_options"] else []) + \
            ([select_text(r)] if r["select"] != "sorted" else []) + \
            (["attention kernel"] if r["attention"] == "kernel" else []) + \
            ([f"selection {r['selection']}"] if r["selection"] != "topk_union" else []) + \
            ([f"order {r['order']}"] if r["order"] != "xla" else [])  # (deleted options' rows)
    return "; ".join([text] * bool(text) + extra)


def step_cells(r: dict) -> str:
    """The first cells of a step table's row: method, context, batch, mesh, split and index writes."""
    return f"| {r['method']} | {r['context']} | {r['batch']} | {r['mesh']} | {split_text(r)} | {writes_text(r)} |"


def select_text(r: dict) -> str:
    """A threshold-selection row's selection and how often its second path ran (a deleted option's rows)."""
    text = f"{r['select']} selection"
    if r.get("selections"):
        text += f" (second path {r['second_path'] / r['selections']:.1%})"
    return text


def merge(paths, out_prefix):
    """One results file from several runs of this script (device calls are limited to 10 minutes each)."""
    import json

    parts = [json.load(open(p)) for p in paths]
    res = dict(parts[0])
    res["runs"] = [run for p in parts for run in (p.get("runs") or [{"command": p["command"], "machine": p["machine"],
                                                                   "wall_seconds": p.get("wall_seconds")}])]
    for p in parts:  # each row upgraded to today's fields; its run's read mode and date travel with it
        p["rows"] = [migrate(row, p["config"]) | {"run_date": row.get("run_date", p["machine"]["date"])}
                     for row in p.get("rows", [])]
        for err in p.get("errors", []):  # an error names the run it came from (a later run may have measured it)
            err.setdefault("run_date", p["machine"]["date"])
    res["errors"] = [x for p in parts for x in p.get("errors", [])]
    res["notes"] = list(dict.fromkeys(x for p in parts for x in p.get("notes", [])))  # in order, once each
    # A later run of the same measurement (same kind, method, shapes, placement) supersedes an earlier one.
    latest: dict[tuple, dict] = {}
    for row in (x for p in parts for x in p.get("rows", [])):
        key = tuple(str(row.get(f)) for f in ("kind", "method", "context", "batch", "memory", "read", "mesh",
                                              *OLD_ROW_FIELDS, "shared_kv", "tag", "weight_gemms"))
        if key not in latest or row["run_date"] >= latest[key]["run_date"]:
            older = latest.get(key)
            if older is not None and "profile" in older and "profile" not in row:  # the newest profile stays, dated
                row = row | {"profile": older["profile"], "profile_run_date": older.get("profile_run_date",
                                                                                         older["run_date"])}
            latest[key] = row
    superseded = sum(len(p.get("rows", [])) for p in parts) - len(latest)
    res["rows"] = list(latest.values())
    tail = " rows of earlier runs superseded by later runs of the same measurement"
    earlier = [note for note in res["notes"] if note.endswith(tail) and note.split(" ", 1)[0].isdigit()]
    superseded += sum(int(note.split(" ", 1)[0]) for note in earlier)  # a merged file merged again: one count
    res["notes"] = [note for note in res["notes"] if note not in earlier]
    if superseded:
        res["notes"].append(f"{superseded}{tail}")
    newest = max((p for p in parts if p.get("link")), key=lambda p: p["machine"]["date"], default={})
    res["link"] = newest.get("link", {})  # floors of the newest rows use the newest link measurement
    res["hbm_copy"] = next((p["hbm_copy"] for p in parts if "hbm_copy" in p), None) or {}
    res["links"] = [link for p in parts for link in (p.get("links") or ([{"command": p["command"], "link": p["link"]}]
                                                                       if p.get("link") else []))]
    res["command"] = "; ".join(p["command"] for p in parts)
    res["machine"] = max((p["machine"] for p in parts), key=lambda m: m["date"])  # the header names the newest run
    link = res["link"].get("all", next(iter(res["link"].values()), {})).get("GBps")
    for row in res["rows"]:  # the link floor of rows measured in a run without the link section
        floor = row.get("link_floor_ms", float("nan"))
        if row["kind"] == "attention" and row["memory"] == "pinned_host" and link and math.isnan(floor):
            row["link_floor_ms"] = (row.get("link_scan_bytes", row["scan_bytes"]) + row["row_bytes_max"]) / (link * 1e9) * 1e3
            row["fraction_of_link"] = row["link_floor_ms"] / row["median_ms"]
    harness.write_json(out_prefix + ".json", res)
    write_report(res, out_prefix)


def mesh_ratio_lines(att: list[dict]) -> list[str]:
    """Each step measured on one GPU and on a mesh of several with the same method, shapes and reads, side by side."""
    def key(r):  # chunk counts differ with the groups per device: pipelined pairs with pipelined
        return (r["method"], r["context"], r["batch"], r["memory"], r["read"], r["shared_kv"], r["index_writes"],
                r["streams"], int(r["pipeline"]) > 1, bool(r["scan_writes"]), r["rows"])

    single = {key(r): r for r in att if r["mesh"] == 1}
    pairs = [(single[key(r)], r) for r in att if r["mesh"] > 1 and key(r) in single]
    if not pairs:
        return []
    lines = ["## Several GPUs against one (same method, context, reads, K/V sharing, index writes and pipelining)", "",
             "| method | context | read | shared K/V | index writes | chunks (1 GPU / mesh) | 1 GPU ms | mesh | mesh ms | ratio | "
             "mesh floor ms | x floor | runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for one, many in sorted(pairs, key=lambda p: (p[1]["context"], p[1]["method"], str(p[1]["shared_kv"]), key(p[1])[6:])):
        lines.append(f"| {many['method']} | {many['context']} | {key(many)[4]} | {many['shared_kv']} | {writes_text(many)} | "
                     f"{one['pipeline']} / {many['pipeline']} | {one['median_ms']:.1f} | "
                     f"{many['mesh']} | {many['median_ms']:.1f} | {many['median_ms'] / one['median_ms']:.2f} | "
                     f"{many['link_floor_ms']:.1f} | {many['median_ms'] / many['link_floor_ms']:.2f} | "
                     f"{str(one.get('run_date', ''))[:16]} / {str(many.get('run_date', ''))[:16]} |")
    return lines + [""]


def _cell(x, spec: str) -> str:
    """A table cell: ``x`` formatted, blank where it is None or NaN (not measured)."""
    return "" if x is None or x != x else format(x, spec)


def row_format_lines(rows: list[dict]) -> list[str]:
    """The row-format table: every row of a compressed format beside the rows of the model dtype (bf16) with the same
    step, method, context and batch, with their bytes per token on the host, row bytes per step, ms and tokens/s."""
    def key(r):
        return (r["kind"], r["method"], r["context"], r["batch"])

    compressed = [r for r in rows if r["rows"] != "model"]
    if not compressed:
        return []
    keys = {key(r) for r in compressed}
    picked = [r for r in rows if key(r) in keys]
    lines = ["## K/V row formats", "",
             "`rows`: how the cache stores each token's K and V (`model`: bf16 K and V side by side; `k8v8`: 8-bit K and V, "
             "one fp16 absmax scale per token each; `fathom_jax.rows.layout`). Host B/token: bytes per token, layer and KV "
             "head in host memory as held (`shared K/V`: one row buffer for every layer, counted once) and with every "
             "layer's own rows (the row plus the index's planes and scales); row B: what the row fetch moves per selected "
             "token; rows MB: the selected rows of a step (max, the union's upper bound).", "",
             "| step | method | context | batch | rows | shared K/V | host B/token (held) | host B/token (own rows) | "
             "row B | rows MB (max) | ms | tokens/s | vs model rows | run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:  # the fastest model-dtype row of each step: the comparison
        if r["rows"] == "model" and (key(r) not in base or r["median_ms"] < base[key(r)]["median_ms"]):
            base[key(r)] = r
    for r in sorted(picked, key=lambda r: key(r) + (r["rows"] != "model", r["rows"],
                                                     str(r.get("run_date", "")))):
        b = base.get(key(r))
        ratio = f"{b['median_ms'] / r['median_ms']:.2f}x" if b is not None and b is not r else ""
        lines.append(f"| {r['kind']} | {r['method']} | {r['context']} | {r['batch']} | {r['rows']} | "
                     f"{r['shared_kv']} | {_cell(r.get('host_bytes_per_token'), '.0f')} | "
                     f"{_cell(r.get('host_bytes_per_token_own'), '.0f')} | "
                     f"{_cell(r.get('row_bytes_per_token'), '.0f')} | "
                     f"{_cell(r.get('row_bytes_max', float('nan')) / 1e6, '.0f')} | "
                     f"{r['median_ms']:.2f} [{r['min_ms']:.2f}, {r['max_ms']:.2f}] | "
                     f"{_cell(r.get('tokens_per_s', r['batch'] / r['median_ms'] * 1e3), '.1f')} | {ratio} | "
                     f"{str(r.get('run_date', ''))[:16]} |")
    return lines + [""]


def row_cache_lines(rows: list[dict]) -> list[str]:
    """Rows with drifting queries or a row cache, each beside the row of the same step without a cache."""
    rows = [migrate(r) for r in rows]
    picked = [r for r in rows if r["row_cache"] or r.get("query_drift") is not None]
    if not picked:
        return []

    def key(r):
        return (r["kind"], r["method"], r["context"], r["batch"], r.get("query_drift"), r["pipeline"],
                r["index_writes"], r["rows"], str(r.get("run_date", "")))

    plain = {key(r): r for r in rows if not r["row_cache"]}
    lines = ["## Row cache (device-memory copies of the rows recent steps fetched)", "",
             "`drift`: each step's queries are the last step's times the coefficient plus fresh noise (AR(1); none: one "
             "query set repeated, which a row cache would hit every time; full steps: the random model's own queries). "
             "`from slots`: of the last step's selected rows, the share taken from the slots. Floors: every planned byte "
             "and every selected row over the link, and with only the rows fetched.", "",
             "| step | method | context | batch | drift | slots | from slots | rows MB fetched | ms | floor ms (all rows) | "
             "floor ms (rows fetched) | ms / floor (fetched) | vs no cache |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(picked, key=lambda r: key(r) + (r["row_cache"],)):
        base = plain.get(key(r))
        slots = r["row_cache"]
        share = f"{100 * r['row_hit_fraction']:.0f}%" if slots else ""
        fetched_mb = r["row_bytes_fetched"] / 1e6 if slots else r.get("row_bytes_max", float("nan")) / 1e6
        floor = r.get("link_floor_fetched_ms") if slots else None
        speedup = f"{base['median_ms'] / r['median_ms']:.2f}x" if slots and base else ""
        lines.append(f"| {r['kind']} | {r['method']} | {r['context']} | {r['batch']} | {r.get('query_drift') or 'none'} | "
                     f"{slots} | {share} | {fetched_mb:.0f}{'' if slots else ' (max)'} | {r['median_ms']:.2f} "
                     f"[{r['min_ms']:.2f}, {r['max_ms']:.2f}] | {_cell(r.get('link_floor_ms'), '.1f')} | "
                     f"{_cell(floor, '.1f')} | "
                     f"{_cell(None if floor is None else r['median_ms'] / floor, '.2f')} | {speedup} |")
    return lines + [""]


def write_report(res: dict, prefix: str) -> None:
    m = res["machine"]
    link = res.get("link", {})
    lines = [f"# Offloaded sparse decoding ({m['device']} x{m.get('devices', res['config'].get('mesh', 1))})", "",
             f"{m['date']}, JAX {m['jax']}, commit {m['commit']}, host {m['host']}. Command: `{res['command']}`.",
             "Model: Qwen3-8B shapes (36 layers, 32 query / 8 KV heads, D = 128, hidden 4096, MLP 12288), random bf16 "
             "weights; k = 512; caches synthetic (keys with log-normal channel scales, index built from them); "
             "`shared_kv`: all layers read one K/V row buffer (each layer keeps its own planes).",
             f"Link (device_put of {res['config'].get('link_bytes', 0) / 2**30:.0f} GiB from pinned_host): " +
             ", ".join(f"{k} {v['GBps']:.1f} GB/s" for k, v in link.items()) +
             (f"; HBM copy {res['hbm_copy']['GBps']:.0f} GB/s" if res.get("hbm_copy") else ""), ""]
    if res.get("runs"):
        lines += ["Runs merged: " + "; ".join(f"`{r['command']}` ({r['machine']['date']})" for r in res["runs"]), ""]
    for entry in res.get("links", [])[1:]:
        lines += [f"Link in `{entry['command'][:60]}...`: " + ", ".join(f"{k} {v['GBps']:.1f} GB/s" for k, v in entry["link"].items()), ""]
    rows = [migrate(r, res["config"]) for r in res["rows"]]
    att = [r for r in rows if r["kind"] == "attention"]
    if att:
        lines += ATTENTION_HEAD
        for r in sorted(att, key=lambda r: (r["context"], r["method"], r["rows"], r["read"] or "", r["streams"],
                                            r["pipeline"], r["gather_programs"], r["index_writes"],
                                            bool(r["scan_writes"]))):
            lines.append(f"{step_cells(r)} {r['memory']} | {r['read']} | {r['shared_kv']} | "
                         f"{r['bits_per_token']:.1f} | {r['scan_bytes'] / 1e6:.0f} | {r['row_bytes_max'] / 1e6:.0f} | "
                         f"{r['median_ms']:.2f} [{r['min_ms']:.2f}, {r['max_ms']:.2f}] | {r['link_floor_ms']:.1f} | "
                         f"{r['fraction_of_link']:.2f} | {r.get('authors_ms') or ''} | {str(r.get('run_date', ''))[:16]} |")
        lines.append("")
        lines += mesh_ratio_lines(att)
    full = [r for r in rows if r["kind"] == "full"]
    if full:
        lines += FULL_HEAD
        for r in sorted(full, key=lambda r: (r["context"], r["batch"], r["method"], r["rows"], r["streams"],
                                             r["pipeline"], r["index_writes"], r["weight_gemms"],
                                             str(r.get("run_date")))):
            lines.append(f"{step_cells(r)} {r['weight_gemms']} | {r['median_ms']:.2f} "
                         f"[{r['min_ms']:.2f}, {r['max_ms']:.2f}] | {r['tokens_per_s']:.1f} | "
                         f"{r.get('wall_over_device', float('nan')):.2f} |")
        lines.append("")
    lines += row_format_lines(att + full)
    lines += row_cache_lines(att + full)
    lines += inputs_lines(att)
    lines += tier_lines(att)
    for r in full + att:
        if "profile" in r:
            p = r["profile"]
            what = "full step" if r["kind"] == "full" else f"attention-only step ({r['memory']})"
            what += f", {split_text(r)}" if split_text(r) else ""
            what += ", plane blocks written when full" if r["index_writes"] == "full_blocks" else ""
            what += ", each layer's writes in the layer scan" if r["scan_writes"] else ""
            if r.get("profile_run_date"):  # profiled in an earlier run of this measurement than the row's median
                what += f" (profiled in the run of {r['profile_run_date'][:16]}; median above from {r['run_date'][:16]})"
            lines += [f"Profile of the {what}, {r['method']} at {r['context']} (batch {r['batch']}): wall "
                      f"{p['wall_ms_per_step']:.1f} ms, device span {p['device_span_ms_per_step']:.1f} ms, busy "
                      f"{p['device_busy_ms_per_step']:.1f} ms per step; "
                      + ", ".join(f"{k} {v:.1f}" for k, v in p["ms_per_step"].items()) + " ms"
                      + (f"; {p['launches_per_step']:.0f} kernel launches per step." if "launches_per_step" in p else "."), ""]
            if p.get("exposed_ms_per_step"):
                x = p["exposed_ms_per_step"]
                lines += [f"Of its span, a plane transfer ran for {x['transfer_running']:.1f} ms per step; with none running: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in x["outside_transfers"].items()) + " ms.", ""]
            if p.get("top_kernels"):
                lines += ["| kernel | category | ms per step | launches per step |", "|---|---|---|---|"]
                lines += [f"| `{t['name'][:90]}` | {t['category']} | {t['ms_per_step']:.2f} | {t['launches_per_step']:.0f} |"
                          for t in p["top_kernels"][:15]]
                lines.append("")
    pre = [r for r in rows if r["kind"] == "prefill"]
    for r in pre:
        lines += [f"Prefill of a {r['context']}-token prompt into host memory: {r['prefill_s']:.1f} s "
                  f"(first call, with compilation: {r['first_s']:.1f} s); index build {r['index_build_s']:.2f} s "
                  f"({100 * r['index_share']:.1f}%).", ""]
    if res.get("errors"):
        when = lambda e: f"run of {e['run_date'][:16]}" if e.get("run_date") else "run not recorded"  # noqa: E731
        lines += ["## Errors", ""] + [f"- {e['section']} ({when(e)}): {e['error'][:300]}" for e in res["errors"]] + [""]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batch_plot([r for r in rows if r["kind"] == "full"], prefix + "_batches.png", m["device"])
    if not att:
        return
    fig, ax = plt.subplots(figsize=(11, 5.2))
    colors = dict(zip(sorted({r["method"] for r in att}), plt.get_cmap("tab10").colors))
    for label in sorted(colors):
        # (read, index writes, pipelined, style); GPU-stream rows stay in the table (measured slower)
        for read, writes, pipelined, style in (
                ("staged", "every_step", False, "o-"), ("staged", "every_step", True, "*-"),
                ("staged", "full_blocks", False, "D:"), ("staged", "full_blocks", True, "*:"),
                ("direct", "every_step", False, "o--")):
            best = {}
            want = (label, 1, "pinned_host", 1, read, 1, writes, pipelined, "model")  # compressed rows: their own table
            for r in att:  # of several settings, the fastest at each context
                if (r["method"], r["batch"], r["memory"], r["mesh"], r["read"], r["streams"], r["index_writes"],
                        r["pipeline"] > 1, r["rows"]) == want:
                    best[r["context"]] = min(r["median_ms"], best.get(r["context"], r["median_ms"]))
            pts = sorted(best.items())
            if pts:
                extra = (", blocks written when full" if writes == "full_blocks" else "") + (", pipelined" if pipelined else "")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colors[label],
                        label=f"{label} ({read}{extra})")
        authors = sorted((c, v[label]) for c, v in AUTHORS_MS.items() if label in v)
        if authors and any(r["method"] == label for r in att):
            ax.plot([a[0] for a in authors], [a[1] for a in authors], "x", color=colors[label], ms=9,
                    label=f"{label}, authors' implementation")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _save_plot(fig, ax, f"{m['device']}: index + K/V in pinned host memory, one GPU", prefix + ".png",
               "context (tokens)", "attention-only step (ms, 36 layers)", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    tier_plot(att, prefix + "_tiers.png", m["device"])


def _save_plot(fig, ax, title: str, path: str, xlabel: str, ylabel: str, **legend) -> None:
    """The axes labelled, gridded and titled, the legend drawn (``legend``: its placement), the figure saved."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, **legend)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tier_rows(att: list[dict]) -> list[dict]:
    """The rows of runs that recorded where the index lived (since resident planes exist)."""
    return [r for r in att if "index_hbm_bytes" in r and r["memory"] == "pinned_host"]


def tier_lines(att: list[dict]) -> list[str]:
    """The resident-planes table: each row beside the same method, context and batch with the index on the host."""
    rows = _tier_rows(att)
    if not any(r["resident_planes"] for r in rows):
        return []
    base = {(r["method"], r["context"], r["batch"], r["rows"]): r for r in rows
            if not r["resident_planes"] and not r.get("warm_planes")}
    lines = ["## Resident planes", "",
             "`p`: planes [0, p) of every channel, and every block scale, in HBM; planes [p, 4) in pinned host memory "
             "(p = 4: the whole index in HBM); `+ S warm`: S more channel planes per layer and group in HBM, chosen "
             "from the step's queries (`Placement.warm_planes`). Link MB: the planned planes (and, at p = 0, scales) "
             "that cross the link per step; the floor adds the selected rows (max) at the link rate measured in the "
             "run.", "",
             "| method | context | batch | p | index host GB | index HBM GB | link MB (planes) | rows MB (max) | ms | "
             "tokens/s | link floor ms | vs p = 0 | link bytes vs p = 0 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["method"], r["context"], r["batch"], r["rows"],
                                         str(r["resident_planes"]), r["warm_planes"])):
        b = base.get((r["method"], r["context"], r["batch"], r["rows"]))
        speed = f"{b['median_ms'] / r['median_ms']:.2f}x" if b else ""
        share = f"{r['link_scan_bytes'] / b['link_scan_bytes']:.2f}" if b and b["link_scan_bytes"] else ""
        p = f"{r['resident_planes']}" + (f" + {r['warm_planes']} warm" if r["warm_planes"] else "")
        lines.append(f"| {r['method']} | {r['context']} | {r['batch']} | {p} | "
                     f"{r['index_host_bytes'] / 1e9:.2f} | {r['index_hbm_bytes'] / 1e9:.2f} | "
                     f"{r['link_scan_bytes'] / 1e6:.0f} | {r['row_bytes_max'] / 1e6:.0f} | "
                     f"{r['median_ms']:.2f} [{r['min_ms']:.2f}, {r['max_ms']:.2f}] | {r['batch'] / r['median_ms'] * 1e3:.1f} | "
                     f"{r['link_floor_ms']:.1f} | {speed} | {share} |")
    return lines + [""]


def tier_plot(att: list[dict], path: str, device: str) -> None:
    """Step time against the HBM bytes of the index per session, one line per method and context."""
    import matplotlib.pyplot as plt

    rows = _tier_rows(att)
    if not any(r["resident_planes"] for r in rows):
        return
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for (method, context), style in zip(sorted({(r["method"], r["context"]) for r in rows}),
                                        ("o-", "s-", "D-", "^-", "o--", "s--", "D--", "^--")):
        pts = sorted((r["index_hbm_bytes"] / r["batch"] / 1e9, r["median_ms"]) for r in rows
                     if (r["method"], r["context"]) == (method, context) and isinstance(r["resident_planes"], int))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{method}, {context // 1024}k")
    ax.set_yscale("log")
    _save_plot(fig, ax, f"{device}: resident planes (p = 0, 1, 2, 4)", path, "HBM bytes of the index per session (GB)",
               "attention-only step (ms, 36 layers)")


def batch_plot(full: list[dict], path: str, device: str) -> None:
    """Tokens per second of the full step against the batch size (sessions of their own), one line per method,
    context, row format and resident planes; only where a line has two batch sizes or more."""
    import matplotlib.pyplot as plt

    lines: dict[tuple, dict[int, float]] = {}
    for r in full:  # of several settings, the fastest at each batch
        pts = lines.setdefault((r["method"], r["context"], r["rows"], r["resident_planes"], r["shared_kv"]), {})
        pts[r["batch"]] = max(r["tokens_per_s"], pts.get(r["batch"], 0.0))
    lines = {k: v for k, v in lines.items() if len(v) > 1}
    if not lines:
        return
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for (method, context, rows, p, shared), pts in sorted(lines.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], "o-", label=f"{method}, {context // 1024}k, {rows} rows, p = {p}"
                + (", shared K/V" if shared else ""))
    ax.set_xscale("log", base=2)
    _save_plot(fig, ax, f"{device}: full decode step against the batch size", path,
               "batch (sessions decoded together)", "tokens per second (full step)")
