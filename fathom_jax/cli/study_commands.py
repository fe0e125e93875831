"""``fathom ruler`` and ``fathom agreement``: the downstream sweeps on a real model from the command line.

    fathom ruler --context 4096 --k 64 128 --per-task 8       # runs/ruler_smollm2_4k.{json,md,png}
    fathom agreement --context 4096 --sessions 40             # runs/agreement_smollm2_4k.{json,md,png}
    fathom tune --context 4096 --mean 37 55                   # runs/calibrations/tuned_smollm2_4k_mean{37,55} (orbax)
    fathom ruler --model gemma3-270m --context 8192           # runs/ruler_gemma3_8k.{json,md,png}

:func:`register` adds the subcommands to an ``argparse`` subparsers object. Every argument is checked
before the model loads; a bad one is a :class:`~fathom_jax.cli.args.UsageError` (one line, exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

from fathom_jax.cli.args import (RUNS, Distinct, UsageError, add_model_arguments, check_memory, check_out_dir,
                                 check_positions, compare_with_committed, fraction, model_help, model_slug, model_title,
                                 peak_bytes, positive_int, run_metadata, untuned_error)
from fathom_jax.eval import downstream as ds
from fathom_jax.eval import resume
from fathom_jax.eval import ruler as ruler_lib
from fathom_jax.eval import sweeps

# ruler and agreement select from small k too (downstream.forced_tokens), down to downstream.MIN_K
DOWNSTREAM_K = positive_int(ds.MIN_K, f" ({ds.SMALL_K})")

SMOLLM2_POSITIONS = 8192  # SmolLM2-135M's max_position_embeddings (each run checks its model's own)

# How long a run takes, in --help: measured numbers, each with where it comes from.
_LONG_RUN = """\
Ctrl-C stops a run with one line saying what was saved: every finished decode (batch x method) is written to
<out>/{kind}_smollm2_<context>.partial.jsonl as it finishes, and the same command with --resume continues
from there, to the results an uninterrupted run writes. The progress bar's ETA starts at the first finished
decode and leaves compile time out (shown apart, with the programs still to compile added)."""

# How long, in --help: numbers from committed results files (tests/cli/test_app.py checks them against the files).
RULER_TIME = """\
How long, at the defaults (11 methods = 21 branches, 48 prompts per context, batch 2: 504 decodes):
  on an H200 machine (16 cores, 125.9 GiB): 472 s at --context 4096 and 556 s at 8192
  (results/ruler_smollm2_{4k,8k}.json, meta.wall_s; batch 8 and 4, two other sweeps sharing the GPU);
  on a 2-core CPU: no run to the end is recorded; plan on hours per context.

""" + _LONG_RUN.format(kind="ruler")

AGREEMENT_TIME = """\
How long, at the defaults (11 methods = 21 branches, 40 sessions, batch 2: 420 decodes of 64 tokens):
  on an H200 machine (16 cores, 125.9 GiB): 487 s at --context 4096 (results/agreement_smollm2_4k.json,
  meta.wall_s; batch 8, two other sweeps sharing the GPU);
  on a 2-core CPU: no run to the end is recorded; plan on hours per context.

""" + _LONG_RUN.format(kind="agreement")


def register(subparsers) -> None:
    """Add the ``ruler`` and ``agreement`` parsers to the ``fathom`` CLI (``cli.COMMAND_MODULES``)."""
    from fathom_jax import methods

    method_help = "dense, the exact top-k oracle, or scans: " + methods.spec_help(", ")
    p = subparsers.add_parser(
        "ruler", help="RULER-style tasks on a real model, every method decoding from one dense prefill",
        description="RULER-style retrieval and tracking tasks (paper 5.5) on SmolLM2-135M-Instruct (or --model) with "
                    "a haystack of Python's documentation prose; one dense prefill per sample, greedy decoding "
                    "branched per method; writes <out>/ruler_<model>_<context>.json/.md/.png (--out: runs/).",
        epilog=RULER_TIME)
    p.add_argument("--context", type=positive_int(512), nargs="+", default=[4096], action=Distinct,
                   help=f"tokens of cache: prompt + {sweeps.RESERVED} (a multiple of 64, at most the model's positions: "
                        f"{SMOLLM2_POSITIONS} for SmolLM2)")
    p.add_argument("--k", type=DOWNSTREAM_K, nargs="+", default=[64, 128], action=Distinct,
                   help=f"selection sizes, tokens per query head (the same for every method; at least {ds.MIN_K}: "
                        f"{ds.SMALL_K})")
    p.add_argument("--tasks", nargs="+", default=list(ruler_lib.TASKS), action=Distinct,
                   help=f"tasks: {', '.join(ruler_lib.TASKS)}")
    p.add_argument("--per-task", type=positive_int(1), default=8, help="samples per task and context")
    p.add_argument("--seed", type=int, default=0, help="seed of the samples (needles, keys, depths)")
    p.add_argument("--methods", nargs="+", default=None, help=method_help + "; default: the paper's set at the model's "
                   f"head_dim (D = 64: {' '.join(ds.DEFAULT_METHODS)})")
    _common(p)
    p.set_defaults(func=run_ruler_command)

    p = subparsers.add_parser(
        "agreement", help="step agreement with exact top-k on standard-library code sessions",
        description="Step agreement (paper 5.6): every method decodes the next tokens of real code sessions from "
                    "one dense prefill; the score is the word-level sequence-match ratio against the exact top-k "
                    "step. Writes <out>/agreement_<model>_<context>.json/.md/.png (--out: runs/).",
        epilog=AGREEMENT_TIME)
    p.add_argument("--context", type=positive_int(512), nargs="+", default=[4096], action=Distinct,
                   help="tokens of cache: session + steps (a multiple of 64, at most the model's positions)")
    p.add_argument("--sessions", type=positive_int(2, " (a standard error needs two)"), default=40,
                   help="code sessions")
    p.add_argument("--k-fraction", type=fraction, nargs="+", default=[0.02, 0.005], action=Distinct,
                   help=f"selection sizes as fractions of the context (k = fraction x context: at least {ds.MIN_K})")
    p.add_argument("--steps", type=positive_int(1), default=64, help="tokens each method decodes")
    p.add_argument("--methods", nargs="+", default=None, help=method_help + "; default: as for fathom ruler")
    p.add_argument("--baseline", default=None,
                   help="the method paired differences are taken against (default: SparQ r = D/4; D = 64: sparq:16)")
    _common(p)
    p.set_defaults(func=run_agreement_command)

    p = subparsers.add_parser(
        "tune", help="per-(layer, KV head) budgets tuned with optax on the calibration text, saved with orbax",
        description="Captures --context tokens of the pydoc prose on SmolLM2-135M-Instruct (or --model), measures each "
                    "(layer, KV head)'s attention error of fathom_bits:B:observed at a grid of budgets (the study's, "
                    "scaled to the model's head_dim), tunes budgets at each --mean with optax and saves each as an "
                    "orbax calibration (fathom_tuned:observed reads it; load_calibration loads it).")
    p.add_argument("--context", type=positive_int(512), default=4096,
                   help="tokens of calibration text captured (at most the model's positions)")
    p.add_argument("--mean", type=positive_int(9), nargs="+", default=[37, 55],
                   help="mean budgets over the model, bits per token as read (code + scale), within the tuning grid: "
                        f"{tuning_grid_text()} at D = 64")
    p.add_argument("--positions", type=positive_int(1), default=128,
                   help="positions of the capture measured, spread over its second half")
    p.add_argument("--k", type=positive_int(36), default=128, help="selection size the error is measured at")
    p.add_argument("--out", default=os.path.join(RUNS, "calibrations"),
                   help="folder for tuned_<model>_<context>_mean<M> checkpoints (ignored by git)")
    p.add_argument("--force", action="store_true", help="overwrite existing checkpoints")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_arguments(p)
    p.set_defaults(func=run_tune_command)


def tuning_grid(head_dim: int) -> tuple[int, ...]:
    """The budgets ``fathom tune`` measures at ``head_dim``: the study's tuning grid scaled to it."""
    from fathom_jax.eval import tuning
    from fathom_jax.methods import fathom_budgets

    return fathom_budgets(head_dim, tuning.GRID_AT_128)


def tuning_grid_text(head_dim: int = 64) -> str:
    grid = tuning_grid(head_dim)
    return f"({grid[0]}, {grid[-1]}] bits"


def _common(p) -> None:
    p.add_argument("--model", default=None, help=model_help())
    p.add_argument("--batch", type=positive_int(1), default=2, help="samples prefilled and decoded together")
    p.add_argument("--calibration", choices=sweeps.CALIBRATIONS, default="corpus",
                   help="statistics for Fathom, Double Sparsity and Loki: a capture of the pydoc prose (corpus) "
                        "or each prompt's own keys (session)")
    p.add_argument("--calib-tokens", type=positive_int(128), default=4096,
                   help="tokens of the pydoc prose captured for the corpus statistics (and the bits per token)")
    p.add_argument("--rows", nargs="+", default=[ds.MODEL_ROWS], action=Distinct,
                   help="K/V row formats every scan decodes with, each a branch of its own: model (the model's dtype) "
                        "or a format with per-token scales, e.g. k8v8; the exact top-k oracle always decodes with the "
                        "model's rows too, the reference of every comparison")
    p.add_argument("--out", default=RUNS, help="folder for the results files (ignored by git; --out results replaces "
                                               "a committed one)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: skip the contexts whose results files exist for the same "
                        "arguments and the decodes its .partial.jsonl file saved (Ctrl-C saves them as they finish)")


def _model_config(args: argparse.Namespace):
    """The model's config, read from its metadata (no weights loaded; SmolLM2's GGUF takes seconds to read, said
    first: the command printed nothing for half a minute)."""
    from fathom_jax.models import hub

    print(f"[{args.command}] reading {model_title(args.model)}'s metadata to check the arguments", flush=True)
    return hub.model_config(args.model)


def _methods(args: argparse.Namespace, model_config) -> tuple[str, ...]:
    """``--methods`` (or the default set), each checked against the model and the statistics these commands have; a
    selection shared across layers (``METHOD@share=...``) against the model's layers."""
    from fathom_jax.methods.sharing import SharedMethod

    head_dim = model_config.head_dim
    for spec in args.methods or ():
        if spec.strip().lower() == "dense":
            continue
        try:
            (method,) = ds.parse_methods([spec])
            method.validate(head_dim)
            if isinstance(method, SharedMethod):
                method.sharing.plan(model_config)  # its layers must be the model's
                method = method.method
        except ValueError as err:
            raise UsageError(f"argument --methods: {err}") from None
        message = untuned_error(method, f"{args.command}'s corpus or session statistics")
        if message:
            raise UsageError(f"argument --methods: {message}")
    return tuple(args.methods) if args.methods else ds.default_methods(head_dim)


def _checked(configs, check, out: str, model_config):
    """Every config checked against the model and the output folder proven writable, before the model loads."""
    for config in configs:
        try:
            check(config, model_config.max_position_embeddings, model_config.head_dim)
        except ValueError as err:
            raise UsageError(str(err)) from None
    check_out_dir(out)
    return configs


def ruler_configs(args: argparse.Namespace) -> list[sweeps.RulerConfig]:
    """One config per context, every argument checked (before any model is loaded)."""
    model_config = _model_config(args)
    configs = [sweeps.RulerConfig(context=c, ks=tuple(args.k), tasks=tuple(args.tasks), per_task=args.per_task,
                                  methods=_methods(args, model_config), batch=args.batch, seed=args.seed,
                                  calibration=args.calibration, calib_tokens=args.calib_tokens, rows=tuple(args.rows))
               for c in args.context]
    return _checked(configs, sweeps.check_ruler, args.out, model_config)


def agreement_configs(args: argparse.Namespace) -> list[sweeps.AgreementConfig]:
    from fathom_jax.methods import at_head_dim

    model_config = _model_config(args)
    d = model_config.head_dim
    baseline = args.baseline or at_head_dim("sparq:D/4", d)
    for c in args.context:  # k = 4 at 0.001 of 4096 tokens ran (an ETA of 2 h) before this check
        for f in args.k_fraction:
            k = max(1, round(f * c))
            if 0 < f <= 1 and k < ds.MIN_K:
                raise UsageError(f"argument --k-fraction: {f:g} of --context {c} is k = {k} tokens per query head, "
                                 f"fewer than {ds.MIN_K} ({ds.SMALL_K}); use a fraction of at least "
                                 f"{math.ceil(ds.MIN_K / c * 1e4) / 1e4:g} at this context")
    configs = [sweeps.AgreementConfig(context=c, sessions=args.sessions, k_fractions=tuple(args.k_fraction),
                                      steps=args.steps, methods=_methods(args, model_config), baseline=baseline,
                                      batch=args.batch, calibration=args.calibration,
                                      calib_tokens=args.calib_tokens, rows=tuple(args.rows))
               for c in args.context]
    return _checked(configs, sweeps.check_agreement, args.out, model_config)


def _label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def _run(kind: str, configs, args, run) -> int:
    """Each config's sweep, its finished (batch, method) decodes saved as they finish in
    ``<out>/<kind>_smollm2_<context>.partial.jsonl`` (removed once the results are written). ``--resume`` skips
    the contexts whose results exist for the same configuration and the decodes the partial file holds."""
    from fathom_jax.eval import downstream_report
    from fathom_jax.models import hub

    t0 = time.time()
    todo, written, running = [], [], []
    for config in configs:  # the saved runs are read (and checked against the arguments) before the model loads
        prefix = os.path.join(args.out, f"{kind}_{model_slug(args.model)}_{_label(config.context)}")
        said = lambda line: print(f"[{kind}] --resume: {line}", flush=True)  # noqa: E731
        if args.resume and resume.finished(prefix + ".json", dataclasses.asdict(config), said):
            print(f"[{kind}] --resume: {prefix}.json holds this configuration's results already; skipped", flush=True)
            continue
        log = resume.UnitLog(prefix + ".partial.jsonl", {"kind": kind, "config": dataclasses.asdict(config)},
                             resume=args.resume)
        todo.append((config, prefix, log))

    def saved() -> str:
        held = [f"{len(log.saved)} finished decodes in {log.path}" for log in running[-1:] if log.saved]
        return ", ".join(held + [f"{p}.json written" for p in written]) or "nothing had finished"

    with resume.stop_on_interrupt(kind, saved, args.argv):
        if todo:
            print(f"[{kind}] loading {model_title(args.model)}", flush=True)
        model, tokenizer, _ = hub.load_model(args.model) if todo else (None, None, None)
        meta = {"model": model_title(args.model), **run_metadata(args)}
        for config, prefix, log in todo:
            running.append(log)
            res = run(config, model, tokenizer, progress=not args.quiet, meta=meta, log=log)
            paths = downstream_report.write_report(res, prefix)
            log.remove()
            written.append(prefix)
            print(downstream_report.render_markdown(res))
            print(f"[{kind}] wrote {', '.join(paths)}")
            compare_with_committed(kind, prefix + ".json")
    print(f"[{kind}] done in {time.time() - t0:.0f} s")
    return 0


def run_ruler_command(args: argparse.Namespace) -> int:
    return _run("ruler", ruler_configs(args), args, sweeps.run_ruler)


def run_agreement_command(args: argparse.Namespace) -> int:
    return _run("agreement", agreement_configs(args), args, sweeps.run_agreement)


def run_tune_command(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    import numpy as np

    from fathom_jax import calibrate as cal
    from fathom_jax.eval import texts, tuning
    from fathom_jax.eval.fidelity import Capture
    from fathom_jax.models import capture_qkv, hub
    from fathom_jax.models.tokenizer import encode_prompt

    model_config = hub.model_config(args.model)  # its metadata: every argument is checked before the model loads
    grid = tuning_grid(model_config.head_dim)
    bad = [m for m in args.mean if not grid[0] < m <= grid[-1]]
    if bad:
        raise UsageError(f"argument --mean: {bad} outside ({grid[0]}, {grid[-1]}] bits (the tuning grid at the "
                         f"model's head_dim {model_config.head_dim})")
    if args.positions > args.context // 2 or args.k > args.context:
        raise UsageError(f"argument --positions/--k: {args.positions} positions and k = {args.k} do not fit "
                         f"--context {args.context}")
    check_positions(args.context, model_config, args.allow_long_context, f"--context {args.context} asks for")
    check_memory(peak_bytes(model_config, args.context, capture_texts=1), f"tune --context {args.context}",
                 args.no_memory_check)
    check_out_dir(args.out)
    tokenizer = hub.load_tokenizer(args.model)
    all_ids = encode_prompt(tokenizer, texts.calibration_text()[0])
    if len(all_ids) < args.context:
        raise UsageError(f"argument --context: the calibration text has {len(all_ids)} tokens with this model's "
                         f"tokenizer, fewer than --context {args.context}")
    t0 = time.time()
    model, _, _ = hub.load_model(args.model)
    ids = texts.token_window(all_ids, args.context, name="calibration text")
    capture = Capture(**capture_qkv(model, jnp.asarray(ids)))
    tuned, tables = tuning.tune_calibration(capture, args.mean, grid=grid, k=args.k, positions=args.positions,
                                            progress=not args.quiet)
    for mean, calib in tuned.items():
        path = os.path.join(args.out, f"tuned_{model_slug(args.model)}_{_label(args.context)}_mean{mean}")
        cal.save_calibration(path, calib, force=args.force)
        b = np.asarray(calib.budget)
        print(f"[tune] mean {mean}: budgets {b.min():g}-{b.max():g} bits per (layer, KV head) -> {path}")
    print(f"[tune] done in {time.time() - t0:.0f} s")
    return 0
