"""What the plane scan's packed-f16 arithmetic costs in attention fidelity, on a real model and real text.

The ``f16x2`` scan (``PlaneScanConfig(math="f16x2")``) rounds its weights and partial sums to f16, so its scores lie
within :func:`pallas_kernels.plane_scan.f16x2_error_bound` of the exact ones and a top-k may differ at near-ties.
This runs the fidelity study's protocol (:mod:`fathom_jax.eval.fidelity`: at each of a window's last positions the
index a decode loop holds there, sink 4 + local 32 + top-(k - 36) per head, exact attention over the selection against
dense attention) with the method's scores from the kernel in each arithmetic (interpreted on a CPU: the f16 FMA
emulated; natively on a GPU) and from the XLA reference, and compares the errors position by position.

    python -m scripts.scan_precision --context 4096 --positions 64 --methods fathom:48

writes ``results/scan_precision_<model>_<context>.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import methods
from fathom_jax.eval import fidelity as fid
from fathom_jax.eval import texts
from fathom_jax.eval.scoring import MethodScore
from fathom_jax.eval.sweeps import corpus_calibration
from fathom_jax.methods.base import ScanMethod
from fathom_jax.scan import IndexSource, check_scan_inputs, mask_invalid
from pallas_kernels.plane_scan import PlaneScanConfig
from scripts import harness

SCANS = {"xla": ("xla", None), "f32": ("triton", PlaneScanConfig()), "f16x2": ("triton", PlaneScanConfig(math="f16x2"))}


@dataclasses.dataclass(frozen=True)
class KernelScore:
    """A fidelity score function (``fn(q, keys, length, calib) -> (scores, bits)``) scanning with one implementation
    and plane-scan configuration: the index a decode loop holds at ``length``, scanned as the decode step scans it."""

    method: ScanMethod
    implementation: str
    scan: PlaneScanConfig | None

    def __call__(self, q, keys, length, calib):
        index = MethodScore(self.method).index(keys, calib, length)
        q = check_scan_inputs(self.method, q, index, calib)
        read = self.method.read(q, index, calib, implementation=self.implementation)
        scores = read.scores(IndexSource(index, index.length, self.implementation, self.scan))
        return mask_invalid(scores, index.length), read.bits.astype(jnp.float32)


def main(argv=None):
    from fathom_jax.models import capture_qkv
    from fathom_jax.models.hub import KNOWN_MODELS, known_model, load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=KNOWN_MODELS)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=64, help="decode positions at the window's end")
    ap.add_argument("--k", default="128,256", help="selection sizes (a list)")
    ap.add_argument("--methods", default="fathom:48")
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    ks = tuple(int(k) for k in args.k.split(","))
    t0 = time.time()
    spec_file = known_model(args.model)
    model, tok, cfg = load_model(args.model)
    eval_text, eval_info = texts.evaluation_text()
    cap = fid.Capture(**capture_qkv(model, jnp.asarray(texts.token_window(tok.encode(eval_text), args.context,
                                                                           name="evaluation text"))))
    calib, _, _ = corpus_calibration(model, tok, args.calibration_tokens)
    positions = np.arange(args.context - args.positions, args.context, dtype=np.int32)
    evaluations, labels = [], []
    for spec in args.methods.split(","):
        method = methods.parse(spec)
        for scan, (implementation, config) in SCANS.items():
            evaluations.append(fid.Evaluation(KernelScore(method, implementation, config),
                                              calib if method.needs_calibration else None, f"{spec} {scan}"))
            labels.append((spec, scan))
    results = fid.attention_errors_many(evaluations, cap, ks, positions=positions, reuse_blocks=False, progress=True)
    errors = {label: np.asarray(e) for label, (e, _) in zip(labels, results)}  # [K, L, P, Hkv, G]
    res = {"machine": harness.machine(), "command": harness.command("scripts.scan_precision", argv),
           "config": vars(args).copy(), "model": spec_file.title, "text": eval_info,
           "backend": jax.default_backend(), "rows": []}
    for spec in args.methods.split(","):
        base = errors[(spec, "f32")]
        for scan in SCANS:
            e = errors[(spec, scan)]
            for i, k in enumerate(ks):
                diff = (e[i] - base[i]).reshape(-1)
                res["rows"].append({"method": spec, "scan": scan, "k": k, "error": float(e[i].mean()),
                                    "vs_f32": float(e[i].mean() / base[i].mean()),
                                    "diff_mean": float(diff.mean()),
                                    "diff_stderr": float(diff.std(ddof=1) / np.sqrt(diff.size)),
                                    "heads_changed": float(np.mean(diff != 0))})
    res["wall_seconds"] = round(time.time() - t0, 1)
    prefix = os.path.join(args.out, f"scan_precision_{spec_file.slug}_{args.context // 1024}k")
    print(harness.write_results(prefix, res, report))


def report(res: dict) -> str:
    c = res["config"]
    lines = [f"# The plane scan's arithmetic and attention fidelity ({res['model'].split(' (')[0]}, "
             f"{c['context']} tokens)", "",
             f"{res['machine']['date']}, JAX {res['machine']['jax']}, commit {res['machine']['commit']}, backend "
             f"{res['backend']} (the kernels "
             f"{'interpreted, the f16 FMA emulated' if res['backend'] != 'gpu' else 'native'}). "
             f"Command: `{res['command']}`. The fidelity study's protocol over the evaluation text's last "
             f"{c['positions']} positions, every layer and head; the method's scores from the XLA reference (`xla`), "
             "the plane-scan kernel in f32 (`f32`, the default) and in packed f16 (`f16x2`).", "",
             "`error`: mean relative L2 error of the attention output against dense attention; `vs f32`: its ratio to "
             "the f32 kernel's; `diff`: the mean per-(position, layer, head) difference to the f32 kernel's error, "
             "± its standard error; `heads changed`: the share of (position, layer, head) errors that differ at all.",
             "", "| method | scan | k | error | vs f32 | diff ± s.e. | heads changed |",
             "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['method']} | {r['scan']} | {r['k']} | {r['error']:.5f} | {r['vs_f32']:.4f} | "
                     f"{r['diff_mean']:+.2e} ± {r['diff_stderr']:.1e} | {r['heads_changed']:.3f} |")
    lines.append(f"\nWall time {res['wall_seconds']} s.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
