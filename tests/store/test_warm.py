"""Warm channel planes: which a group keeps (the planner's gains past the resident planes), the prompt's importance
they are ranked by, and which plane each warm row holds."""

import jax.numpy as jnp
import numpy as np

from fathom_jax.planner import prompt_importance
from fathom_jax.store.tiered import warm_choice, warm_sources


def test_warm_choice_takes_the_largest_gains_past_the_resident_planes():
    # gains g 4^-i at planes >= 1: ch 0 (g = 8): 2, 0.5, 0.125; ch 1 (g = 1): 0.25, ...; ch 2 (g = 3): 0.75, 0.1875, ..
    importance = jnp.asarray([[8.0, 1.0, 3.0], [0.0, 0.0, 0.0]])
    got = np.asarray(warm_choice(importance, 1, 4))
    want = np.zeros((2, 3, 4), np.int32)
    want[0, 0, 1], want[0, 2, 1], want[0, 0, 2], want[0, 1, 1] = 1, 2, 3, 4  # rows in order of gain
    want[1, 0, 1], want[1, 0, 2], want[1, 0, 3], want[1, 1, 1] = 1, 2, 3, 4  # ties: lower channel, then plane
    np.testing.assert_array_equal(got, want)
    assert not np.asarray(warm_choice(importance, 4, 3)).any()  # every plane resident: nothing past them
    sources, held = warm_sources(jnp.asarray(want), 5)
    np.testing.assert_array_equal(np.asarray(sources)[0, :4], [1, 9, 2, 5])  # channel * 4 + plane
    np.testing.assert_array_equal(np.asarray(held), [[True] * 4 + [False]] * 2)
    # the prompt's importance: sum over heads of q^2, averaged over each group's last `window` valid positions
    q = jnp.arange(2 * 2 * 5 * 3, dtype=jnp.float32).reshape(2, 2, 5, 3) / 10  # [R, G, T, D]
    length = jnp.asarray([5, 3])
    got = np.asarray(prompt_importance(q, jnp.ones((2, 3)), length, window=2))
    energy = np.sum(np.square(np.asarray(q)), axis=1)  # [R, T, D]
    np.testing.assert_allclose(got, [energy[0, 3:5].mean(0), energy[1, 1:3].mean(0)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(prompt_importance(q, 2 * jnp.ones((2, 3)), length, window=9)),
                               2 * np.stack([energy[0].mean(0), energy[1, :3].mean(0)]), rtol=1e-6)
