"""Rotary embeddings and the layers."""

import dataclasses

import numpy as np

from fathom_jax.models import layers
from fathom_jax.models.config import RopeScaling


def test_llama3_inv_freq_regimes(tiny_config):
    CFG = tiny_config
    cfg = dataclasses.replace(CFG, head_dim=16, rope_theta=5e5,
                              rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    base = layers.rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    scaled = layers.rope_inv_freq(cfg)
    wavelen = 2 * np.pi / base
    np.testing.assert_allclose(scaled[wavelen < 16], base[wavelen < 16])  # high freq: kept
    np.testing.assert_allclose(scaled[wavelen > 64], base[wavelen > 64] / 8)  # low freq: / factor
    mid = (wavelen >= 16) & (wavelen <= 64)
    assert mid.any() and np.all((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8))


