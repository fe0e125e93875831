"""The ``fathom`` command: ``app`` (the parser, every subcommand registered, the error convention), ``args`` (the
argument types and checks every command shares), and the commands: ``model_commands`` (fetch-model, sweep),
``generate_command``, ``study_commands`` (the evaluations), ``row_formats_command``."""

from fathom_jax.cli.app import build_parser, main, run

__all__ = ["build_parser", "main", "run"]
