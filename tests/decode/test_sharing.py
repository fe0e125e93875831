"""Selection shared across layers in the step: what a selection layer publishes is the study's set of its scores
(:func:`~fathom_jax.decode.sharing.shared_positions`), and a sharing layer's attention over it is the study's
(:func:`~fathom_jax.eval.shared_selection.shared_attention`), newest token included, on the reference and the kernels."""

import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import index as I
from fathom_jax import methods as M
from fathom_jax.decode import sharing
from fathom_jax.eval.shared_selection import shared_attention
from fathom_jax.index import parts as P
from fathom_jax.methods.sharing import SharedSelection
from fathom_jax.scan import scan_scores
from tests.decode.support import D, N, R, context, stacked_setting, step_setting

BUDGET = 60


@pytest.fixture(scope="module")
def setting():
    return step_setting()


@pytest.mark.parametrize("ranking", ["mass", "rank"])
def test_a_selection_layer_publishes_the_studys_set(setting, ranking):
    keys, values, q, lengths, calib = setting
    method = M.Fathom(20)
    view, kv_cache, new = stacked_setting(setting, method)
    ctx = context()
    from fathom_jax.decode import CacheView

    layer = CacheView(index=view, kv=kv_cache, length=jnp.asarray(lengths), calib=calib, layer=jnp.int32(1), new=new)
    got = sharing.publish(method, jnp.asarray(q), layer, ctx, SharedSelection((0,), BUDGET, ranking), kv_heads=1)
    index = I.build_index(keys, calib, method.parts - {P.KEYS}, length=lengths)
    scores = scan_scores(method, jnp.asarray(q), index, calib, implementation="xla").scores
    want, mask = sharing.shared_positions(scores[:, None], jnp.asarray(lengths), BUDGET, scale=1 / np.sqrt(D),
                                          ranking=ranking)
    want = np.sort(np.where(np.asarray(mask), np.asarray(want), N + 1), axis=-1)
    np.testing.assert_array_equal(np.asarray(got.mask), want <= N)
    np.testing.assert_array_equal(np.asarray(got.positions), np.where(want <= N, want, -1))
    assert np.all(np.asarray(got.positions)[np.asarray(got.mask)] < np.repeat(lengths, BUDGET).reshape(R, -1)[
        np.asarray(got.mask)])


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_a_sharing_layer_attends_the_published_rows(setting, implementation):
    """Every head attends each position of its sequence's set, the newest token's row patched in."""
    keys, values, q, lengths, calib = setting
    view, kv_cache, new = stacked_setting(setting, M.Fathom(20))
    rng = np.random.default_rng(3)
    positions = np.stack([np.sort(rng.choice(n, BUDGET, replace=False)) for n in lengths]).astype(np.int32)
    positions[:, -1] = lengths - 1  # the newest token, which only the patch holds
    mask = np.ones_like(positions, bool)
    mask[2, :10] = False  # a shorter set
    shared = sharing.SharedSet(jnp.asarray(np.where(mask, positions, -1)), jnp.asarray(mask))
    from fathom_jax.decode import CacheView

    layer = CacheView(index=view, kv=kv_cache, length=jnp.asarray(lengths), calib=calib, layer=jnp.int32(1), new=new)
    got, _ = sharing.attend_shared(jnp.asarray(q), layer, context(implementation), shared, kv_heads=1)
    want = shared_attention(jnp.asarray(q)[:, None], jnp.asarray(keys)[:, None], jnp.asarray(values)[:, None],
                            jnp.asarray(np.maximum(positions, 0)), jnp.asarray(mask))[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
