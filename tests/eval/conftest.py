"""The real model's fixtures (SmolLM2 and the transformers oracle) for the downstream sweeps' tests."""

from tests.models.conftest import smollm2, smollm2_path, smollm2_ref  # noqa: F401  (fixtures)
