"""``fathom row-formats``: the attention error each compressed K/V row format adds (:mod:`fathom_jax.eval.row_study`).

Runs written apart join through :func:`fathom_jax.eval.row_report.merge`.
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from fathom_jax.cli.args import (K_TYPE, RUNS, UsageError, add_model_arguments, check_memory, check_out_dir,
                                 compare_with_committed, peak_bytes, positive_int, run_metadata)
from fathom_jax.eval import fidelity as fid
from fathom_jax.eval.row_study import OPEN, RowStudyConfig, check_config, run_meta, run_row_study
from fathom_jax.rows import formats as row_formats


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "row-formats", help="attention error each compressed K/V row format adds, against host bytes per token",
        description="Every method of the error-vs-bits study selects from the captured keys; attention runs over "
                    "the selected rows as each row format decodes them. Writes <out>/<prefix>.json/.md/.png.")
    p.add_argument("--context", type=positive_int(OPEN), nargs="+", default=[4096, 8192], help="window lengths")
    p.add_argument("--positions", type=positive_int(1), default=128, help="decode positions at the end of each window")
    p.add_argument("--k", type=K_TYPE, nargs="+", default=None, help="selection sizes (default: the study's)")
    p.add_argument("--formats", nargs="+", default=list(row_formats.STUDY_FORMATS),
                   help="row formats: " + row_formats.SPEC_SYNTAX)
    p.add_argument("--methods", nargs="+", default=[], help="method specs (default: every flat row of the study)")
    p.add_argument("--out", default=RUNS, help="folder for the results files (ignored by git)")
    p.add_argument("--prefix", default="row_formats_smollm2", help="results file names: <prefix>.json/.md/.png")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_model_arguments(p)
    p.set_defaults(func=run_command)


def run_command(args) -> int:
    from fathom_jax.eval import row_report, texts
    from fathom_jax.models import capture_qkv, hub

    if "f32" in args.formats:
        raise UsageError("argument --formats: f32 (the captured rows) is always measured; name stored formats only")
    formats = tuple(dict.fromkeys(["bf16", *args.formats]))  # bf16 rows: what every added error is taken against
    model_config = hub.model_config(args.model)
    configs = [RowStudyConfig(context=c, ks=tuple(args.k or ()), positions=args.positions, formats=formats,
                              methods=tuple(args.methods)) for c in args.context]
    try:
        for config in configs:
            check_config(config, model_config.head_dim)
            if config.context > model_config.max_position_embeddings and not args.allow_long_context:
                raise ValueError(f"context {config.context} is past the model's {model_config.max_position_embeddings}")
    except ValueError as err:
        raise UsageError(str(err)) from None
    check_out_dir(args.out)
    longest = max(args.context)
    check_memory(peak_bytes(model_config, longest, capture_texts=2), f"row-formats --context {longest}",
                 args.no_memory_check)
    tokenizer = hub.load_tokenizer(args.model)
    (calib_text, calib_info), (eval_text, eval_info) = texts.calibration_text(), texts.evaluation_text()
    calib_all, eval_all = tokenizer.encode(calib_text), tokenizer.encode(eval_text)
    model, _, _ = hub.load_model(args.model)
    meta = run_meta({"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32)" if args.model is None
                     else os.fspath(args.model), "calib_text": calib_info, "eval_text": eval_info,
                     **run_metadata(args)})
    meta["command"] = getattr(args, "command_line", meta["command"])  # run from the script: its own command line
    runs = []
    for config in configs:
        capture = lambda ids: fid.Capture(**capture_qkv(model, jnp.asarray(texts.token_window(ids, config.context))))  # noqa: E731
        print(f"[row-formats] capturing q/k/v over {config.context} tokens of each text", flush=True)
        runs.append(run_row_study(capture(eval_all), capture(calib_all), config, progress=not args.quiet))
    results = {"meta": meta, "runs": runs}
    paths = row_report.write_report(results, os.path.join(args.out, args.prefix))
    print(row_report.render_markdown(results))
    print(f"[row-formats] wrote {', '.join(paths)}")
    compare_with_committed("row-formats", os.path.join(args.out, args.prefix) + ".json")
    return 0
