"""Sparse decoding with any scan method, in HBM or host memory: the decoder's attention and everything under it.

    from fathom_jax import decode, methods
    attn = decode.SparseAttention(methods.Fathom(48), k=128, calibration=calib)   # corpus: calib [L, Hkv]
    attn = decode.from_spec("fathom_klt:48", k=128)                              # session calibration
    attn = decode.from_spec("fathom:48", k=512, placement="pinned_host",         # where the cache lives
                            step=decode.StepConfig(index_writes="full_blocks"))  # how a step runs
    ids = fathom_jax.models.generate(model, prompt, 64, attention_fn=attn)

One decode step's data flow, file by file:

* ``hook.py``: :class:`SparseAttention`, the models' ``CacheAttention`` protocol (and :func:`from_spec`), delegating
  to the modules below; its static fields and their checks are ``spec.py``'s
  :class:`~fathom_jax.decode.spec.AttentionSpec`, its cache allocation, prompt writes and statistics ``prefill.py``'s;
* ``step.py``: per layer (:func:`~fathom_jax.decode.step.layer_step`) the new token added to every index part (its
  newest block, in device memory), the layer's :class:`~fathom_jax.decode.step.CacheView`, and (in host memory) the
  token's row and blocks written in place inside the layer scan; the step itself: plan (the method), read
  (``reads.py``), select (``selection.py``: the top-k and the group's union), fetch
  (``fetches.py``), attend; in pipelined chunks where the resolved configuration says so;
* ``sharing.py``: a selection shared across layers: what a selection layer publishes, how a sharing layer attends it;
* ``config.py``: :class:`StepConfig` (how a step runs), resolved once per cache shape into the strategies
  (:class:`ResolvedStep`);
* ``cache.py`` / ``writes.py`` / ``row_cache.py``: the stacked :class:`SparseCache` and its allocation, its writes
  (prefill, new token, commit, flush), the optional row cache; how it stores each token's K/V row is
  :class:`~fathom_jax.rows.layout.RowLayout` (``fathom_jax.rows``), where it lives a
  :class:`~fathom_jax.placement.Placement`;
* ``cache_program.py`` / ``programs.py``: how a compiled program over a placed cache is made (donation, in-place host
  writes), and the programs: the attention-only benchmark step, flush, a sparse cache from a dense prefill.
"""

from fathom_jax.calibrate import Calibration, calibrate
from fathom_jax.decode.cache import LayerUpdate, SparseCache, cache_bytes
from fathom_jax.decode.config import ResolvedStep, StepConfig
from fathom_jax.decode.hook import SparseAttention, from_spec
from fathom_jax.decode.programs import (
    attention_step,
    cache_from_dense,
    cache_shape,
    flush,
)
from fathom_jax.decode.row_cache import RowCache, RowFill, commit_rows, empty_row_cache
from fathom_jax.decode.spec import AttentionSpec
from fathom_jax.decode.step import (
    CacheView,
    NewToken,
    StepContext,
    StepResult,
    sparse_attention_step,
)
from fathom_jax.index import build_index
from fathom_jax.placement import Placement, attach_bulk, device_mesh, split_bulk
from fathom_jax.rows.layout import RowLayout, row_format

__all__ = [
    "AttentionSpec", "CacheView", "LayerUpdate", "NewToken", "ResolvedStep", "RowCache", "RowFill", "SparseAttention",
    "SparseCache", "StepConfig", "StepContext", "StepResult", "attention_step", "cache_bytes", "cache_from_dense",
    "cache_shape", "commit_rows", "empty_row_cache", "flush", "from_spec", "sparse_attention_step",
    # what the hook takes, from the rooms below: its calibration, where its cache lives (and a cache's bulk leaves
    # apart from its small ones), its row format, the index a prompt's keys give
    "Calibration", "calibrate", "Placement", "attach_bulk", "device_mesh", "split_bulk", "RowLayout",
    "row_format", "build_index",
]
