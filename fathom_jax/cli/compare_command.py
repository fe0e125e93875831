"""``fathom compare A B``: whether results file A measures what B does (their run records left out); exit status 0
when they agree, 1 when they differ, as ``cmp`` does."""

from __future__ import annotations

import argparse

from fathom_jax.cli.args import UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="compare two results files, their run records (meta) left out",
        description="Whether results file A measures what B does, number by number: e.g. the main job's "
                    "runs/fidelity_smollm2_4k_64pos.json against the committed results/fidelity_smollm2_4k_64pos.json. "
                    "One line; exit status 0 when they agree, 1 when they differ.")
    p.add_argument("a", help="a results file (.json)")
    p.add_argument("b", help="the results file to compare it with")
    p.add_argument("--rtol", type=_rtol, default=0.0,
                   help="relative difference under which two numbers count as equal (0: bit for bit)")
    p.set_defaults(func=_compare)


def _rtol(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a relative difference in [0, 1), got {text!r}")
    return value


def _compare(args: argparse.Namespace) -> int:
    from fathom_jax.eval import compare

    for name in ("a", "b"):
        try:
            compare.load(getattr(args, name))
        except ValueError as err:
            raise UsageError(f"argument {name}: {err}") from None
    result = compare.files(args.a, args.b, args.rtol)
    print(result.line())
    return 0 if result.same() else 1
