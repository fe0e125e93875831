"""The K/V row-format study on SmolLM2: host bytes per token against the attention error each format adds.

    python -m scripts.row_formats_study                       # 4k and 8k: results/row_formats_smollm2.{json,md,png}
    python -m scripts.row_formats_study --context 4096 --positions 32 --methods exact --prefix check
    python -m scripts.row_formats_study --merge a.json b.json --prefix row_formats_smollm2   # runs written apart

The same command as ``fathom row-formats`` once the CLI registers :mod:`fathom_jax.eval.row_study`.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from fathom_jax.cli import row_formats_command
from fathom_jax.cli.args import UsageError


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--merge"]:
        return merge(argv[1:])
    parser = argparse.ArgumentParser(prog="row_formats_study")
    row_formats_command.register(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(["row-formats", *argv])
        args.argv = ["row-formats", *argv]
        args.command_line = shlex.join(["python", "-m", "scripts.row_formats_study", *argv])
        return args.func(args)
    except UsageError as err:
        print(f"row_formats_study: {err}", file=sys.stderr)
        return 2


def merge(argv: list[str]) -> int:
    """Join results files written by separate runs into one (``--out``/``--prefix`` as for a run)."""
    import os

    from fathom_jax.eval import row_report

    parser = argparse.ArgumentParser(prog="row_formats_study --merge")
    parser.add_argument("inputs", nargs="+", help="results JSON files of this study")
    parser.add_argument("--out", default="results")
    parser.add_argument("--prefix", default="row_formats_smollm2")
    args = parser.parse_args(argv)
    results = row_report.merge([row_report.load(path) for path in args.inputs])
    print(", ".join(row_report.write_report(results, os.path.join(args.out, args.prefix))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
