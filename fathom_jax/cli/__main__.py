from fathom_jax.cli.app import run

run()
