"""Offloaded sparse decoding of a Qwen3-8B-shaped model: results/offload_<machine>_<tag>.{json,md,png}, <machine> the
device the run used (``h200``, ``h100``, ``h200x2`` for two, ``cpu``: :func:`scripts.harness.machine_name`).

The K/V cache and the key index of every layer live in ``pinned_host`` memory, stacked by layer; HBM holds
the weights, the queries and the selected rows. One compiled program per decode step (36 layers under
``lax.scan``), one per attention-only step (the paper's terms: no weight GEMMs).

Caches are synthetic where no prefill is run: each layer's keys are drawn with log-normal channel scales
(log-variance std 1.25, as the kernel benchmark: ~39 active channels at a budget of 48) and written through
the same path as prefill (the index is built from them, so the planes are real codes); the calibration
variance is the drawn one. Where the host cannot hold every layer's K/V rows (1M tokens on a 128 GiB host),
all layers share one row buffer while each keeps its own planes (``shared_kv`` in the results): the bytes
a step moves are the same.

    python3 -m scripts.bench_offload --out $OUT                      # the default sections: offload_h200.json on an H200
    python3 -m scripts.bench_offload --mesh 2 --out $OUT             # over two GPUs: offload_h200x2.json
    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python3 -m scripts.bench_offload --mesh 2 \
        --out $OUT                                                   # one process per host (fathom_jax.distributed)
    python3 -m scripts.bench_offload --smoke --out /tmp/smoke          # tiny shapes, any backend (CI-size)
    python3 -m scripts.bench_offload --merge results/offload_h200 a.json b.json   # one file from several runs
    python3 -m scripts.bench_offload --preset attn --out $OUT        # the run behind a committed table (PRESETS)
    python3 -m scripts.bench_offload --preset tiers-1m --set resident_planes=1 --set time_budget=120 --out $OUT

A run is one frozen record (``scripts/offload_runs.py``: :class:`~scripts.offload_runs.OffloadRun`): a preset's, or the
defaults, with each ``--set KEY=VALUE`` applied in order; every option is a flag too (``--pipeline 8,2`` is ``--set
pipeline=8,2``), which the commands recorded in results/README.md use.

Sections (``--sections``): link, attn, full, profile, batch, control, dense, prefill; ``attnprofile`` adds a
profiler breakdown (categories and the costliest kernels) to every attention-only row; ``attnbatch``: attention-only
rows of every method and input set at 128k for each of ``--batches``.

K/V row formats (``--rows model,k8v8``; an entry ``FORMAT@SHARE`` sets that format's ``--share-kv-from``): one set
of rows each in the attn, attnbatch, full and batch sections, over a cache of its own; each row records its format
(``rows``), its row bytes per token and per step, and its host bytes per token (as held, and with every layer's own
rows).

Inputs (``--inputs today,honest``: one set of attention-only and control rows each, over a cache of its own;
``scripts/offload_inputs.py``): ``today`` draws the keys every earlier run drew and repeats one query set (or drifts
it by ``--query-drift``); ``honest`` draws keys whose plane-0 shares match SmolLM2's real keys and drifts the queries so
that a step reselects ~63% of the rows of the step before, as real decodes measured. The report puts them side by side.

A row cache (``--row-cache SLOTS``, :class:`fathom_jax.decode.RowCache`) pays only when a step reselects rows
of the steps before it: ``--query-drift RHO`` gives every attention-only step new queries, drifting from the last
step's (AR(1); 0.95 leaves ~37% of the rows new each step, what SmolLM2 measured on real text) instead of one query
set repeated. The report's row-cache table puts each such row beside the same step without a cache.

The code: this file holds the command line and the sections driver (:func:`main`); ``offload_runs.py`` the run record
and its presets; ``offload_setup.py``
the methods, synthetic caches, hooks, step inputs, random model and step options; ``offload_measure.py`` the results
file (:class:`offload_measure.Run`) and each section's timed rows; ``offload_report.py`` ``--merge`` and the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time

from fathom_jax import initialize
from fathom_jax.decode import Placement, device_mesh
from scripts.offload_measure import Run, attention_rows, full_rows, link_section, prefill_section
from scripts.offload_report import merge
from scripts.offload_runs import OPTIONS, PRESETS, QWEN3_8B, SMOKE, OffloadRun  # noqa: F401 (QWEN3_8B: re-exported)
from scripts.offload_setup import METHODS, random_model, rows_tag


class _Override(argparse.Action):
    """Each option flag, and each ``--set KEY=VALUE``, appends ``(key, text)`` in the order given."""

    def __call__(self, parser, namespace, values, option_string=None):
        if self.dest == "set":
            key, eq, values = values.partition("=")
            if not eq:
                parser.error(f"--set takes KEY=VALUE, got {key!r}")
        else:
            key = self.dest
        namespace.overrides = [*getattr(namespace, "overrides", []), (key, values)]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default=None, help=f"the run behind a committed table: {', '.join(PRESETS)}")
    ap.add_argument("--out", default="results")
    ap.add_argument("--set", action=_Override, metavar="KEY=VALUE",
                    help=f"set an option of the run (repeatable): {', '.join(OPTIONS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the whole script)")
    ap.add_argument("--dump-hlo", action="store_true",
                    help="write each attention row's compiled step (GPU) beside the results, to count its kernels")
    for key, (_, text) in OPTIONS.items():  # the same options as flags: --pipeline 8,2 is --set pipeline=8,2
        ap.add_argument(f"--{key.replace('_', '-')}", dest=key, action=_Override, help=text)
    ap.set_defaults(overrides=[])
    return ap


def build(argv: list[str]) -> tuple[OffloadRun, argparse.Namespace]:
    """The run a command line asks for: its preset (or the defaults), then each option in the order given."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.preset is not None and args.preset not in PRESETS:
        ap.error(f"--preset: {args.preset!r} is not a preset; presets: {', '.join(PRESETS)}")
    try:
        spec = PRESETS[args.preset]() if args.preset else OffloadRun()
        spec = dataclasses.replace(spec, model=SMOKE if args.smoke else spec.model, dump_hlo=args.dump_hlo)
        for key, text in args.overrides:
            spec = spec.set(key, text)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    return spec, args


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--merge":  # --merge OUT_PREFIX IN.json ...
        return merge(sys.argv[3:], sys.argv[2])
    initialize()  # one process per host, from the environment (fathom_jax.distributed); else a no-op
    spec, args = build(sys.argv[1:] if argv is None else argv)
    try:
        mesh = device_mesh(spec.mesh)
    except ValueError as e:
        raise SystemExit(f"--mesh {spec.mesh}: {e}") from None
    placement = Placement("pinned_host", mesh=mesh)
    if placement.note:
        print("note:", placement.note, flush=True)
    os.makedirs(args.out, exist_ok=True)
    run = Run(spec, args.out, placement)
    run.res["notes"].append(placement.note or f"bulk cache arrays in {placement.memory_kind} memory")
    labels = list(spec.methods)
    at_128k = 131072 if 131072 in spec.contexts else min(spec.contexts)  # the batch, attnbatch and control sections'
    tiers = [(p, w) for p in spec.resident_planes for w in spec.warm_planes if not w or p < 4]  # (resident, warm)

    def placed(p, w=0):
        return dataclasses.replace(placement, resident_planes=p, warm_planes=w)

    # Sections run in the order given, so a run cut short by its time budget keeps the ones that matter most.
    for section in spec.sections:
        if section == "link":
            run.guard("link", link_section, run)
        elif section == "attn":
            for ctx, (p, w), rows, inputs in itertools.product(sorted(spec.attention_contexts, reverse=True), tiers,
                                                                spec.row_sets, spec.inputs):
                run.guard(f"attn {ctx} p{p}{f'w{w}' if w else ''}{rows_tag(rows)}{inputs_tag(inputs)}", attention_rows,
                          run, ctx, labels, placement=placed(p, w), rows=rows, inputs=inputs)
        elif section in ("full", "batch", "prefill") and run.model is None:
            run.model = run.guard("model", random_model, spec.model, placement)
        if section == "full" and run.model is not None:
            for ctx, p, rows in itertools.product(spec.full_step_contexts, spec.resident_planes, spec.row_sets):
                run.guard(f"full {ctx} p{p}{rows_tag(rows)}", full_rows, run, ctx, labels, placement=placed(p),
                          rows=rows, profile="profile" in spec.sections and ctx == max(spec.full_step_contexts))
        elif section == "batch" and run.model is not None:
            for b, p, rows in itertools.product(spec.batches, spec.resident_planes, spec.row_sets):
                run.guard(f"batch {b} p{p}{rows_tag(rows)}", full_rows, run, at_128k, labels[:1], batch=b,
                          profile="profile" in spec.sections and b == 8, placement=placed(p), rows=rows)
        elif section == "attnbatch":  # attention-only rows of larger batches (the row cache's and tiers' comparison)
            for b, (p, w), rows, inputs in itertools.product(spec.batches, tiers, spec.row_sets, spec.inputs):
                run.guard(f"attn batch {b} p{p}{f'w{w}' if w else ''}{rows_tag(rows)}{inputs_tag(inputs)}",
                          attention_rows, run, at_128k, labels, batch=b, placement=placed(p, w), rows=rows,
                          inputs=inputs)
        elif section == "control":
            for inputs in spec.inputs:
                run.guard(f"control{inputs_tag(inputs)}", attention_rows, run, at_128k, labels,
                          placement=Placement("device", mesh=mesh), tag="index and K/V in HBM", inputs=inputs)
        elif section == "dense":
            METHODS.setdefault("dense", "dense")
            for ctx in [c for c in sorted(spec.contexts) if c <= 131072]:
                run.guard(f"dense {ctx}", attention_rows, run, ctx, ["dense"], tag="dense offload")
        elif section == "prefill" and run.model is not None:
            ctx = 131072 if 131072 in spec.contexts else max(spec.contexts)
            run.guard("prefill", prefill_section, run, ctx)
    run.save()
    print(f"done in {time.time() - run.t0:.0f} s; {len(run.res['errors'])} errors", flush=True)


def inputs_tag(inputs) -> str:
    """A section name's suffix naming an input set (none for today's)."""
    return "" if inputs.name == "today" else f" {inputs.name} inputs"


if __name__ == "__main__":
    main()
