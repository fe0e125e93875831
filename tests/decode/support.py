"""What the step's tests share: a seeded setting of R groups, the step context as the decoder resolves it, and a
stacked two-layer cache with the newest token patched in."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import calibrate as C
from fathom_jax import index as I
from fathom_jax import store as S
from fathom_jax.decode import NewToken, RowLayout, StepConfig, StepContext
from fathom_jax.index import landmarks, page_bounds
from fathom_jax.index import parts as P
from fathom_jax.index.parts import LandmarkBlock, PageBlock, PlaneBlock
from fathom_jax.placement import Placement

R, G, D, N, K = 3, 4, 16, 200, 48


def step_setting():
    """Keys, values and queries of R groups (lengths 200, 131, 64) and their session statistics."""
    rng = np.random.default_rng(11)
    keys = (rng.standard_normal((R, N, D)) * np.exp(rng.normal(size=D))).astype(np.float32)
    values = rng.standard_normal((R, N, D)).astype(np.float32)
    q = (rng.standard_normal((R, G, D)) * np.exp(rng.normal(size=D) / 2)).astype(np.float32)
    lengths = np.array([200, 131, 64], np.int32)
    calib = C.calibrate_session(jnp.asarray(keys), length=lengths)
    return keys, values, q, lengths, calib


def context(implementation="xla", placement=Placement(), k=K, groups=R, capacity=N, **step):
    """The step context of a step over ``groups`` groups of a ``capacity``-token cache (the configuration resolved
    as the decoder resolves it)."""
    run = StepConfig(**step).resolve(placement, groups=groups, capacity=capacity, implementation=implementation)
    return StepContext(k=k, run=run)


def side_by_side(keys, values):
    """The cache's layout: each token's key and value in one row ``[..., n, 2 D]``, in the keys' dtype."""
    keys = jnp.asarray(keys)
    return RowLayout(keys.shape[-1], keys.dtype).join(keys, jnp.asarray(values))


def stacked_setting(setting, method):
    """A stacked two-layer cache, the view of layer 1 with the newest token patched in, and that token."""
    keys, values, q, lengths, calib = setting
    prev = lengths - 1
    parts = method.parts - {P.KEYS}
    layers = [I.build_index(keys * s, calib, parts, length=prev) for s in (0.5, 1.0)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *layers)
    kv = lambda x: jnp.stack([jnp.where(jnp.arange(N)[:, None] < prev[:, None, None], x * s, 0) for s in (0.5, 1.0)])
    kv_cache = side_by_side(kv(keys), kv(values))
    key = keys[np.arange(R), prev]
    value = values[np.arange(R), prev]
    blocks, view = {}, {"length": stacked.length[1]}
    if P.RAW in parts:
        words, scale, tail = jax.vmap(S.append_block)(stacked["raw"].tail[1], jnp.asarray(prev), jnp.asarray(key))
        blocks["raw"] = PlaneBlock(words, scale, tail)
        view["raw"] = dataclasses.replace(stacked["raw"], tail=tail, length=jnp.asarray(lengths))
    if P.LANDMARKS in parts:
        mean, ltail = jax.vmap(landmarks.append_block)(stacked["landmarks"].tail[1], jnp.asarray(prev),
                                                       jnp.asarray(key))
        blocks["landmarks"] = LandmarkBlock(mean, ltail)
        view["landmarks"] = P.Landmarks(means=stacked["landmarks"].means, tail=ltail)
    for part in parts:
        if isinstance(part, P.PageBounds):
            bounds, ptail = jax.vmap(page_bounds.append_page)(stacked[part.name].tail[1], jnp.asarray(prev),
                                                              jnp.asarray(key))
            blocks[part.name] = PageBlock(bounds, ptail)
            view[part.name] = P.Pages(bounds=stacked[part.name].bounds, tail=ptail)
    new = NewToken(position=jnp.asarray(prev), key=jnp.asarray(key), value=jnp.asarray(value), blocks=blocks)
    return stacked.replace(**view), kv_cache, new
