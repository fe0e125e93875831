"""Selection shared across layers (issue 57): attention error of scanning at a few layers, on a real model and text.

The error study's protocol (``fathom sweep``): a window of standard-library code captured once (post-RoPE q/k/v of
every scanning layer), calibrated on as many tokens of pydoc prose; at the window's last ``--positions`` positions,
each rule's layers select with the scan (``--method``, default Fathom at 3/4 bit per channel: ``fathom:48`` at
SmolLM2's D = 64, ``fathom:192`` at Gemma 3's D = 256) and the others attend their shared set, against per-layer
selection at the same k, at the same rows per KV head and at the same bits per step; the exact top-k oracle's
scores shared besides (what sharing costs with no scan error). Selection layers are also chosen on the calibration
capture (``chosen N``). See :mod:`fathom_jax.eval.share_run`.

    python -m scripts.share_fidelity --model smollm2 --context 4096
    python -m scripts.share_fidelity --model gemma3-270m --context 8192

writes ``results/share_fidelity_<model>_<context>.{json,md,png}``. Runs on CPU. ``--tradeoff OFFLOAD_JSON ...``: the
studies' error beside the benchmark's speed rows (:mod:`fathom_jax.eval.share_tradeoff`).
"""

from __future__ import annotations

import argparse
import os
import time

from fathom_jax.eval import share_study as ss
from scripts import harness

DEFAULT_RULES = ("first", "first,mid", "0,2,mid", "every8", "every4", "every2")


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv=None):
    from fathom_jax.models.hub import KNOWN_MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=KNOWN_MODELS)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=128, help="decode positions at the window's end")
    ap.add_argument("--calib-positions", type=int, default=64, help="positions of the calibration capture that "
                                                                    "choose selection layers")
    ap.add_argument("--method", default=None, help="the scan (default: Fathom at 3 D / 4 code bits)")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--budgets", type=_ints, default=(256, 512, 1024))
    ap.add_argument("--row-ks", type=_ints, default=ss.ShareConfig.row_ks, help="per-layer k's of the equal-rows "
                                                                                "comparison")
    ap.add_argument("--rules", nargs="+", default=list(DEFAULT_RULES), help="share= values")
    ap.add_argument("--chosen", type=_ints, default=(2, 3, 4, 6, 8), help="selection layer counts chosen on the "
                                                                           "calibration capture")
    ap.add_argument("--attend", default="all", choices=ss.ATTENDING, help="what a sharing layer's heads attend of "
                    "the set: all of it, or each its exact top k (files: share_fidelity_<model>_<context>_topk)")
    ap.add_argument("--rankings", nargs="+", default=list(ss.RANKINGS), choices=ss.RANKINGS)
    ap.add_argument("--out", default="results")
    ap.add_argument("--render", metavar="JSON", help="only rebuild the markdown and figure beside a results JSON")
    ap.add_argument("--tradeoff", nargs="+", metavar="OFFLOAD_JSON", help="only write the trade-off of these offload "
                                                                          "runs (one machine) and the studies in --out")
    args = ap.parse_args(argv)
    if args.render:
        return render(args.render)
    if args.tradeoff:
        from fathom_jax.eval import share_tradeoff
        from scripts.offload_setup import METHODS

        meta = {"commit": harness.git_commit(), "command": harness.command("scripts.share_fidelity", argv)}
        return print("wrote", ", ".join(share_tradeoff.write(args.tradeoff, args.out, per_layer="Fathom 48", meta=meta,
                                                             shared="Fathom 48 shared", spec=METHODS["Fathom 48 shared"])))
    if not 0 < args.positions < args.context or not 0 < args.calib_positions < args.context:
        ap.error(f"--positions and --calib-positions must lie in (0, --context = {args.context})")
    from fathom_jax.models.hub import model_config

    head_dim = model_config(args.model).head_dim
    method = args.method or f"fathom:{3 * head_dim // 4}"
    try:  # every argument checked before the model loads
        config = ss.ShareConfig(method=method, k=args.k, budgets=args.budgets, rankings=tuple(args.rankings),
                                rules=tuple(args.rules), chosen_counts=args.chosen, positions=args.positions,
                                calib_positions=args.calib_positions, attending=args.attend,
                                row_ks=tuple(sorted({args.k, *args.row_ks})))
    except ValueError as err:
        ap.error(str(err))
    if max(config.budgets) > args.context - args.positions:
        ap.error(f"--budgets: {max(config.budgets)} positions do not fit before the first decode position")
    run(args, config, argv)


def render(path: str) -> None:
    import json

    from fathom_jax.eval import share_report

    with open(path) as f:
        res = json.load(f)
    prefix = path.removesuffix(".json")
    with open(prefix + ".md", "w") as f:
        f.write(share_report.render_markdown(res))
    share_report.plot(res, prefix + ".png")
    print(f"wrote {prefix}.md, {prefix}.png")


def run(args, config: ss.ShareConfig, argv) -> None:
    import jax.numpy as jnp

    from fathom_jax import decode
    from fathom_jax.eval import fidelity as fid
    from fathom_jax.eval import share_report, texts
    from fathom_jax.eval.report import save_report
    from fathom_jax.eval.share_run import run_share_study
    from fathom_jax.eval.study import captured_layers
    from fathom_jax.models import capture_qkv
    from fathom_jax.models.hub import known_model, load_model
    from fathom_jax.models.tokenizer import encode_prompt

    t0 = time.time()
    model, tok, cfg = load_model(args.model)
    calib_text, calib_info = texts.calibration_text()
    eval_text, eval_info = texts.evaluation_text()
    captures = []
    for text in (eval_text, calib_text):
        ids = texts.token_window(encode_prompt(tok, text), args.context)
        captures.append(fid.Capture(**capture_qkv(model, jnp.asarray(ids))))
    eval_cap, calib_cap = captures
    calib = decode.calibrate(calib_cap.k, calib_cap.q)
    spec = known_model(args.model)
    meta = {"model": spec.title, "calib_text": calib_info, "eval_text": eval_info,
            "command": harness.command("scripts.share_fidelity", argv), "machine": harness.machine()}
    res = run_share_study(eval_cap, calib_cap, calib, config, n_layers=cfg.n_layers,
                          scanning_layers=captured_layers(cfg), meta=meta)
    res["meta"]["wall_seconds_with_captures"] = round(time.time() - t0, 1)
    size = f"{args.context // 1024}k" if args.context % 1024 == 0 else f"{args.context}tok"
    suffix = "" if args.attend == "all" else f"_{args.attend}"
    prefix = os.path.join(args.out, f"share_fidelity_{spec.slug}_{size}{suffix}")
    markdown = share_report.render_markdown(res)
    print(markdown)
    print("wrote", ", ".join(save_report(res, prefix, markdown, share_report.plot)))


if __name__ == "__main__":
    main()
