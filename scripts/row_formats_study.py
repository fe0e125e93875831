"""The K/V row-format study on SmolLM2: host bytes per token against the attention error each format adds.

    python scripts/row_formats_study.py                       # 4k and 8k: results/row_formats_smollm2.{json,md,png}
    python scripts/row_formats_study.py --context 4096 --positions 32 --methods exact --prefix check

The same command as ``fathom row-formats`` once the CLI registers :mod:`fathom_jax.eval.row_study`.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from fathom_jax.cli_args import UsageError
from fathom_jax.eval import row_study


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="row_formats_study")
    row_study.register(parser.add_subparsers(dest="command", required=True))
    try:
        args = parser.parse_args(["row-formats", *argv])
        args.argv = ["row-formats", *argv]
        args.command_line = shlex.join(["python", "scripts/row_formats_study.py", *argv])
        return args.func(args)
    except UsageError as err:
        print(f"row_formats_study: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
