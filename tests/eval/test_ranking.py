import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.eval import ranking
from fathom_jax.select import select_topk

_xla = jax.jit(lambda s, length, k: select_topk(s, length, k, implementation="xla"), static_argnums=2)
_fast = jax.jit(ranking.select_topk, static_argnums=2)

CASES = {
    "distinct": lambda x: x,
    "ties": lambda x: jnp.round(x * 2) / 2,  # many equal scores around the k-th
    "blocks of 8": lambda x: jnp.repeat(x[..., ::8], 8, axis=-1),  # landmark scores
    "one value": lambda x: jnp.zeros_like(x),  # every candidate ties: more than the slots, the whole-row path
    "signed zeros": lambda x: jnp.where(x > 0, 0.0, -0.0),  # TopK puts +0 above -0
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n,k,lengths", [(4096, 256, (4033, 4096)), (200, 64, (60, 200)), (512, 128, (130, 300))])
def test_equals_xla_select_topk(case, n, k, lengths):
    """The same indices and mask as select_topk's lax.top_k, including short rows (fewer valid than k
    entries, so -inf ties), rows not a whole number of bitmask words, and ties at the floor."""
    x = jax.random.normal(jax.random.key(n + k), (6, 3, 2, n))
    scores = CASES[case](x)
    length = jnp.broadcast_to(jnp.linspace(*lengths, 6).astype(jnp.int32)[:, None], (6, 3))
    want, got = _xla(scores, length, k), _fast(scores, length, k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
