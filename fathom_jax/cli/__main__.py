import sys

from fathom_jax.cli.app import main

sys.exit(main())
