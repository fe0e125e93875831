"""Sparse decoding in the decoder: prefill into a :class:`~fathom_jax.decode.SparseCache`, one compiled
decode step, for any scan method and either placement (HBM or ``pinned_host``).

* :func:`prefill`: layer by layer, the prompt's K/V rows and key index are written into the stacked
  cache (in place, wherever it lives) while the hidden states advance; attention is
  ``jax.nn.dot_product_attention`` (cuDNN flash attention on the GPU for bf16 / f16 models), the MLP runs
  over token chunks. Session calibration statistics are computed per layer from the prompt's keys.
* :func:`decode_step`: one token per sequence, all layers under one ``lax.scan``: QKV projection, the
  sparse step (plan, read, scan, top-k with sink/local, group union, row fetch, exact attention), output
  projection and MLP; after the scan, every layer's new K/V row and newest index blocks are written in
  place (the cache is donated).

Sequences of different lengths decode together: prompts are right-padded and ``lengths`` says how many
tokens of each are real; every sequence decodes at its own position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.decode import SparseAttention, SparseCache
from fathom_jax.placement import Placement
from fathom_jax.models.cache import KVCache
from fathom_jax.models.llama import LlamaForCausalLM, join_attention, split_attention
from pallas_kernels import backend

PREFILL_MLP_CHUNK = 4096  # tokens per MLP chunk in prefill
PREFILL_QUERY_CHUNK = 1024  # queries per chunk of the XLA prefill attention


def chunked_causal_attention(query, key, value, chunk: int = PREFILL_QUERY_CHUNK):
    """Causal GQA attention ``[B, T, N, D]`` x ``[B, T, K, D]``, one chunk of queries at a time (f32 softmax):
    memory ``B N chunk T`` instead of ``B N T T``."""
    b, t, n, d = query.shape
    kh = key.shape[2]
    pad = -t % chunk
    q = jnp.pad(query, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, (t + pad) // chunk, chunk, kh, n // kh, d)
    keys, values = key.astype(jnp.float32), value.astype(jnp.float32)
    scale = 1.0 / np.sqrt(d)

    def one(args):
        qc, start = args  # [B, chunk, K, G, D]
        logits = jnp.einsum("bckgd,btkd->bkgct", qc.astype(jnp.float32), keys) * scale
        causal = jnp.arange(t)[None, :] <= (start + jnp.arange(chunk))[:, None]
        weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
        return jnp.einsum("bkgct,btkd->bckgd", weights, values)

    starts = jnp.arange(0, t + pad, chunk, dtype=jnp.int32)
    out = jax.lax.map(one, (jnp.moveaxis(q, 1, 0), starts))  # [chunks, B, chunk, K, G, D]
    return jnp.moveaxis(out, 0, 1).reshape(b, t + pad, n, d)[:, :t].astype(query.dtype)


def prefill_attention(q, k, v):
    """Causal attention over the whole prompt: q [B,Hkv,G,T,D], k/v [B,Hkv,T,D] -> [B,Hkv,G,T,D].

    cuDNN's fused flash attention on the GPU for bf16/f16 (linear memory in T); elsewhere, or where cuDNN
    refuses the shapes, XLA over chunks of queries.
    """
    b, hkv, g, t, d = q.shape
    query = q.reshape(b, hkv * g, t, d).transpose(0, 2, 1, 3)  # [B, T, N, D], head n = kv * G + g
    key, value = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    o = None
    if backend.on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            o = jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation="cudnn")
        except Exception:  # noqa: BLE001 - unsupported shapes or cuDNN version: the chunked path is exact too
            o = None
    if o is None:
        o = chunked_causal_attention(query, key, value)
    return o.transpose(0, 2, 1, 3).reshape(b, hkv, g, t, d)


def _layer(model: LlamaForCausalLM, layer):
    graphdef, layer_state = nnx.split(model.layers)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], layer_state))


def prefill_layer(model, h, lengths, cache: SparseCache, layer, attn: SparseAttention):
    """One layer of the prompt: returns the next hidden states, the cache with this layer written, and
    the layer's session calibration (None unless session-calibrated)."""
    cfg = model.config
    b, t, _ = h.shape
    r = b * cfg.n_kv_heads

    def attend(q, k, v):
        return prefill_attention(q, k, v), (k, v)

    h, (k, v) = _layer(model, layer)(cfg, h, jnp.arange(t, dtype=jnp.int32), attend, mlp_chunk=PREFILL_MLP_CHUNK)
    keys, values = k.reshape(r, t, cfg.head_dim), v.reshape(r, t, cfg.head_dim)
    group_lengths = jnp.repeat(lengths, cfg.n_kv_heads)
    session = attn.session_calibration(keys, group_lengths)
    calib = session if session is not None else attn.layer_calibration(layer, r)
    cache = attn.write_layer(cache, layer, keys, values, group_lengths, calib)
    return h, cache, session


def last_logits(model, h, lengths):
    """f32 logits [B, V] at each sequence's last prompt token."""
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return model.logits(model.norm(last))


def decode_step_fn(model, tokens: Int[Array, "B"], cache: SparseCache, attn: SparseAttention):
    """One decode step of every sequence at its own position (pure; jit it, donating the cache)."""
    cfg = model.config
    b, hkv, g, d = tokens.shape[0], cfg.n_kv_heads, cfg.group_size, cfg.head_dim
    r = b * hkv

    def attend_layer(layer, q, k, v):
        o, update = attn.attend(q[:, :, :, 0].reshape(r, g, d), k[:, :, 0].reshape(r, d), v[:, :, 0].reshape(r, d),
                                cache, layer)
        return o.reshape(b, hkv, g, 1, d), update

    x, updates = model.scan_layers(model.embed_tokens(tokens[:, None]), cache.length[:, None], attend_layer,
                                   unroll=attn.placement.layer_unroll)
    cache = attn.commit(cache, updates)
    return model.logits(model.norm(x[:, 0])), cache


def attention_step_fn(q: Float[Array, "L R G D"], key: Float[Array, "L R D"], value: Float[Array, "L R D"],
                      cache: SparseCache, attn: SparseAttention):
    """The attention part of one decode step for every layer, without the weight GEMMs: per layer the sparse
    step for given queries and new keys/values, then the in-place writes (the paper's offload benchmark)."""

    def body(previous, xs):
        q_l, k_l, v_l, layer = xs
        # Layer l starts after layer l - 1's output, as in the model, where its query is computed from that output.
        # A loop iteration per layer serializes them anyway; unrolled (``Placement.layer_unroll``), XLA would
        # otherwise run independent layers side by side, which no decoder can.
        q_l, _ = jax.lax.optimization_barrier((q_l, previous))
        out, update = attn.attend(q_l, k_l, v_l, cache, layer)
        return out.astype(previous.dtype), (out, update)

    _, (out, updates) = jax.lax.scan(body, jnp.zeros(q.shape[1:], q.dtype),
                                     (q, key, value, jnp.arange(cache.n_layers, dtype=jnp.int32)),
                                     unroll=attn.placement.layer_unroll)
    return out, attn.commit(cache, updates)


# ----------------------------------------------------------------------------------------------
# Jitted entry points. Over HBM the whole greedy loop is one program; with the cache in host memory,
# each layer of prefill and each decode step is one program that donates the cache (in-place writes
# into host memory need the donation and a host out_shardings; a host array cannot be a loop carry).


def check_sparse_inputs(model, prompt, lengths, max_new_tokens, capacity, attn):
    cfg = model.config
    b, t = prompt.shape
    lengths_np = np.asarray(lengths)
    if lengths_np.shape != (b,):
        raise ValueError(f"lengths must be [batch] = [{b}], got shape {lengths_np.shape}")
    if np.any(lengths_np < 1) or np.any(lengths_np > t):
        raise ValueError(f"lengths must lie in [1, {t}] (the padded prompt length), got {lengths_np.tolist()}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens}")
    need = int(lengths_np.max()) + max_new_tokens
    if need > capacity:
        raise ValueError(f"prompt of {int(lengths_np.max())} tokens + {max_new_tokens} new tokens exceeds cache "
                         f"capacity {capacity}")
    attn.check(n_layers=cfg.n_layers, hkv=cfg.n_kv_heads, groups=b * cfg.n_kv_heads, capacity=capacity,
               head_dim=cfg.head_dim)


def _init_cache(model, attn, batch, capacity):
    cfg = model.config
    return attn.init_cache(n_layers=cfg.n_layers, batch=batch, kv_heads=cfg.n_kv_heads, capacity=capacity,
                           head_dim=cfg.head_dim, dtype=model.dtype)


def _first_token(logits):
    return jnp.argmax(logits, -1).astype(jnp.int32)


def cache_from_dense(kv: KVCache, lengths, attn: SparseAttention) -> tuple[SparseCache, SparseAttention]:
    """A sparse cache built from a dense prefill's :class:`~fathom_jax.models.KVCache` (post-RoPE keys).

    One dense prefill can serve every method: each builds its own index from the same K/V rows (and, if
    session-calibrated, its statistics from the same prompt keys). ``lengths [B]`` are the valid tokens
    per sequence (right-padded prompts). Returns the cache and the hook with its session calibration.
    Runs eagerly layer by layer in the hook's placement (jit it whole for device memory).
    """
    n_layers, b, hkv, capacity, d = kv.k.shape
    lengths = jnp.asarray(lengths, jnp.int32)
    cache = attn.init_cache(n_layers=n_layers, batch=b, kv_heads=hkv, capacity=capacity, head_dim=d, dtype=kv.k.dtype)
    group_lengths = jnp.repeat(lengths, hkv)
    sessions = []
    for layer in range(n_layers):
        keys, values = kv.k[layer].reshape(b * hkv, capacity, d), kv.v[layer].reshape(b * hkv, capacity, d)
        session = attn.session_calibration(keys, group_lengths)
        calib = session if session is not None else attn.layer_calibration(layer, b * hkv)
        cache = attn.write_layer(cache, layer, keys, values, group_lengths, calib)
        sessions.append(session)
    if sessions[0] is not None:
        attn = attn.with_calibration(jax.tree.map(lambda *xs: jnp.stack(xs), *sessions))
    return attn.prefilled(cache, lengths), attn


# On a GPU the layer scan slices each layer's weights out of the stacked [L, ...] arrays; feeding a Triton GEMM, XLA
# copies every slice first (~386 MB per Qwen3-8B layer, 7.5 ms per decode step on the H200). cuBLAS GEMMs under XLA's
# dynamic-slice fusion read the slice in place: the full step at 128k took 30.5 -> 24.7 ms (run u4,
# results/offload_h200.md). Passed to every program that runs decode steps with the model's weights.
WEIGHT_GEMM_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True}


def decode_compiler_options(extra=None) -> dict | None:
    """XLA options of a program that runs decode steps with the weights: :data:`WEIGHT_GEMM_OPTIONS` on a GPU, then
    ``extra`` (e.g. :attr:`fathom_jax.placement.Placement.compiler_options`); None when empty."""
    options = (dict(WEIGHT_GEMM_OPTIONS) if backend.on_gpu() else {}) | dict(extra or {})
    return options or None


@functools.lru_cache(maxsize=None)
def _device_program(fn, static_argnames, donate_argnames=(), options=()):
    """``fn`` jitted with :func:`decode_compiler_options` (made on first use: the options depend on the backend),
    ``options`` (``(name, value)`` pairs) on top."""
    return jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames,
                   compiler_options=decode_compiler_options(dict(options)))


def generate_program(options: dict | None = None):
    """The jitted program of a whole generation in device memory: prefill, then the greedy loop of decode steps.
    ``options``: more XLA options (:attr:`fathom_jax.placement.Placement.compiler_options`)."""
    return _device_program(_generate_fn, ("graphdef", "max_new_tokens", "capacity", "attn_static"), (),
                           tuple(sorted((options or {}).items())))


def decode_loop_program(options: dict | None = None):
    """The jitted program of :func:`decode_loop` in device memory (the cache donated: the loop updates it in place
    instead of copying all of it first). ``options``: more XLA options, as for :func:`generate_program`."""
    return _device_program(_decode_loop_fn, ("graphdef", "steps", "attn_static"), ("cache",),
                           tuple(sorted((options or {}).items())))


def _decode_loop_fn(graphdef, state, tokens, cache, steps, attn_static, attn_leaves):
    model = nnx.merge(graphdef, state)
    attn = join_attention(attn_static, attn_leaves)
    out = jnp.zeros((tokens.shape[0], steps), jnp.int32).at[:, 0].set(tokens)

    def body(i, carry):
        out, cache = carry
        logits, cache = decode_step_fn(model, out[:, i - 1], cache, attn)
        return out.at[:, i].set(_first_token(logits)), cache

    return jax.lax.fori_loop(1, steps, body, (out, cache))


def decode_loop(model, tokens: Int[Array, "B"], cache: SparseCache, attn: SparseAttention, steps: int):
    """Greedy decoding from a prefilled cache: ``steps`` tokens per sequence, the first being ``tokens``.

    Device memory: one compiled program (a ``fori_loop`` of decode steps). Host memory or a mesh: one
    compiled step per token. Returns ``(tokens [B, steps], cache)``; the cache passed in is donated either way.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    tokens = jnp.asarray(tokens, jnp.int32)
    if not attn.placement.offloaded and attn.placement.mesh is None:
        graphdef, state = nnx.split(model)
        program = decode_loop_program(attn.placement.compiler_options)
        return program(graphdef, state, tokens, cache, steps, *split_attention(attn))
    out = [tokens]
    for _ in range(steps - 1):
        tokens, _, cache = decode_step(model, tokens, cache, attn)
        out.append(tokens)
    return jnp.stack(out, axis=1), cache


def _generate_fn(graphdef, state, prompt, lengths, max_new_tokens, capacity, attn_static, attn_leaves):
    model = nnx.merge(graphdef, state)
    attn = join_attention(attn_static, attn_leaves)
    cache = _init_cache(model, attn, prompt.shape[0], capacity)

    def layer_body(carry, layer):
        h, cache = carry
        h, cache, session = prefill_layer(model, h, lengths, cache, layer, attn)
        return (h, cache), session

    (h, cache), session = jax.lax.scan(layer_body, (model.embed_tokens(prompt), cache),
                                       jnp.arange(model.config.n_layers, dtype=jnp.int32))
    cache = attn.prefilled(cache, lengths)
    if session is not None:
        attn = attn.with_calibration(session)
    out = jnp.zeros((prompt.shape[0], max_new_tokens), jnp.int32)
    out = out.at[:, 0].set(_first_token(last_logits(model, h, lengths)))

    def body(i, carry):
        out, cache = carry
        logits, cache = decode_step_fn(model, out[:, i - 1], cache, attn)
        return out.at[:, i].set(_first_token(logits)), cache

    out, _ = jax.lax.fori_loop(1, max_new_tokens, body, (out, cache))
    return out


@functools.lru_cache(maxsize=None)
def _host_programs(graphdef, attn_static, cache_shardings, out_sharding, in_place, compiler_options=()):
    """Jitted prefill-layer, decode-step and attention-only programs that update a placed cache.

    Each takes the cache as two arguments, its small leaves and its bulk leaves (:meth:`Placement.split_bulk`). The
    small leaves are donated (XLA updates them in place: lengths, tails, a row cache of gigabytes). In device memory
    the bulk leaves are donated too and the whole cache is returned. In host memory the kernels write the bulk
    arrays in place and the programs return the cache without them (``in_place``): returning a host array from a
    program makes XLA copy it, and donating one it does not return would free it. ``compiler_options`` (``(name,
    value)`` pairs, :attr:`fathom_jax.placement.Placement.compiler_options`) go to the step programs; the decode
    step's also take :data:`WEIGHT_GEMM_OPTIONS` on a GPU (the attention-only step has no weight GEMMs).
    """
    out_cache = Placement.detach_bulk if in_place else (lambda c: c)
    join = Placement.join_bulk

    def layer_fn(state, h, lengths, small, bulk, layer, attn_leaves):
        model = nnx.merge(graphdef, state)
        attn = join_attention(attn_static, attn_leaves)
        h, cache, session = prefill_layer(model, h, lengths, join(small, bulk), layer, attn)
        return h, out_cache(cache), session

    def step_fn(state, tokens, small, bulk, attn_leaves):
        model = nnx.merge(graphdef, state)
        logits, cache = decode_step_fn(model, tokens, join(small, bulk), join_attention(attn_static, attn_leaves))
        return _first_token(logits), logits, out_cache(cache)

    def attention_fn(q, key, value, small, bulk, attn_leaves):
        out, cache = attention_step_fn(q, key, value, join(small, bulk), join_attention(attn_static, attn_leaves))
        return out, out_cache(cache)

    def flush_fn(small, bulk, attn_leaves):
        return out_cache(join_attention(attn_static, attn_leaves).flush(join(small, bulk)))

    shardings = out_cache(jax.tree.unflatten(cache_shardings[0], cache_shardings[1]))
    donate = lambda at: (at,) if in_place else (at, at + 1)  # noqa: E731  (small, and bulk unless in place)
    layer_jit = jax.jit(layer_fn, donate_argnums=donate(3), out_shardings=(out_sharding, shardings, out_sharding))
    options = dict(compiler_options) or None
    step_jit = jax.jit(step_fn, donate_argnums=donate(2), out_shardings=(out_sharding, out_sharding, shardings),
                       compiler_options=decode_compiler_options(options))
    attention_jit = jax.jit(attention_fn, donate_argnums=donate(3), out_shardings=(out_sharding, shardings),
                            compiler_options=options)
    flush_jit = jax.jit(flush_fn, donate_argnums=donate(0), out_shardings=shardings)
    return layer_jit, step_jit, attention_jit, flush_jit


class _Programs:
    """The jitted programs of one placement and cache layout, taking and returning whole caches (``jits``: the
    underlying ``jax.jit`` objects, which take a cache as its small and bulk leaves; :meth:`lower_step` lowers the
    decode step, e.g. to inspect its HLO)."""

    def __init__(self, model, attn: SparseAttention, cache: SparseCache):
        graphdef = nnx.split(model)[0] if model is not None else None
        attn_static, _ = split_attention(attn)
        leaves, treedef = jax.tree.flatten(attn.placement.shardings(cache))
        self.in_place = attn.placement.writes_in_place
        self.jits = _host_programs(graphdef, attn_static, (treedef, tuple(leaves)), attn.placement.replicated(),
                                    self.in_place, tuple(sorted(attn.placement.compiler_options.items())))

    def _whole(self, small, cache):
        return Placement.attach_bulk(small, cache) if self.in_place else small

    def layer(self, state, h, lengths, cache, layer, attn_leaves):
        h, small, session = self.jits[0](state, h, lengths, *Placement.split_bulk(cache), layer, attn_leaves)
        return h, self._whole(small, cache), session

    def step(self, state, tokens, cache, attn_leaves):
        nxt, logits, small = self.jits[1](state, tokens, *Placement.split_bulk(cache), attn_leaves)
        return nxt, logits, self._whole(small, cache)

    def lower_step(self, state, tokens, cache, attn_leaves):
        """The decode step's ``jax.stages.Lowered`` for these arguments (nothing runs, nothing is donated)."""
        return self.jits[1].lower(state, tokens, *Placement.split_bulk(cache), attn_leaves)

    def attention(self, q, key, value, cache, attn_leaves):
        out, small = self.jits[2](q, key, value, *Placement.split_bulk(cache), attn_leaves)
        return out, self._whole(small, cache)

    def flush(self, cache, attn_leaves):
        return self._whole(self.jits[3](*Placement.split_bulk(cache), attn_leaves), cache)


def host_programs(model, attn: SparseAttention, cache: SparseCache) -> _Programs:
    """The (prefill layer, decode step, attention-only step) programs for this placement and cache layout."""
    return _Programs(model, attn, cache)


def prefill(model, prompt, lengths, attn: SparseAttention, capacity: int):
    """Prefill ``prompt [B, T]`` (right-padded; ``lengths [B]``) into a new cache, layer by layer.

    Returns ``(logits at each last prompt token [B, V], cache, attn)`` where ``attn`` carries the session
    calibration when it computes one. Works for both placements (one jitted call per layer).
    """
    cfg = model.config
    prompt = jnp.asarray(prompt, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    cache = _init_cache(model, attn, prompt.shape[0], capacity)
    programs = host_programs(model, attn, cache)
    graphdef, state = nnx.split(model)
    _, attn_leaves = split_attention(attn)
    state, attn_leaves = attn.placement.replicate((state, attn_leaves))
    h = _embed(graphdef, state, prompt)
    sessions = []
    for layer in range(cfg.n_layers):
        h, cache, session = programs.layer(state, h, lengths, cache, jnp.int32(layer), attn_leaves)
        sessions.append(session)
    if sessions[0] is not None:
        attn = attn.with_calibration(jax.tree.map(lambda *xs: jnp.stack(xs), *sessions))
    return _last_logits(graphdef, state, h, lengths), attn.prefilled(cache, lengths), attn


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed(graphdef, state, prompt):
    return nnx.merge(graphdef, state).embed_tokens(prompt)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _last_logits(graphdef, state, h, lengths):
    return last_logits(nnx.merge(graphdef, state), h, lengths)


def decode_step(model, tokens, cache: SparseCache, attn: SparseAttention):
    """One jitted decode step: ``(next tokens [B], logits [B, V], cache)``; the cache is donated."""
    programs = host_programs(model, attn, cache)
    _, state = nnx.split(model)
    _, attn_leaves = split_attention(attn)
    state, attn_leaves = attn.placement.replicate((state, attn_leaves))
    return programs.step(state, jnp.asarray(tokens, jnp.int32), cache, attn_leaves)


def attention_step(q, key, value, cache: SparseCache, attn: SparseAttention):
    """One jitted :func:`attention_step_fn`: ``(outputs [L, R, G, D], cache)``; the cache is donated."""
    _, attn_leaves = split_attention(attn)
    return host_programs(None, attn, cache).attention(q, key, value, cache, attn.placement.replicate(attn_leaves))


def flush(cache: SparseCache, attn: SparseAttention) -> SparseCache:
    """:meth:`SparseAttention.flush` as one jitted program (the partial newest plane blocks written into the
    stores, where they live); needed with ``Placement(index_writes="full_blocks")`` before reading the stores."""
    _, attn_leaves = split_attention(attn)
    return host_programs(None, attn, cache).flush(cache, attn.placement.replicate(attn_leaves))


def generate(model, prompt, lengths, max_new_tokens: int, *, capacity: int, attn: SparseAttention):
    """Greedy sparse decoding of ``max_new_tokens`` tokens per sequence; returns ``[B, N]`` token ids.

    Device memory: prefill and the whole loop are one compiled program. ``pinned_host``: prefill layer
    by layer and one compiled step per token, the cache updated in place in host memory.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    check_sparse_inputs(model, prompt, lengths, max_new_tokens, capacity, attn)
    lengths = jnp.asarray(lengths, jnp.int32)
    if not attn.placement.offloaded and attn.placement.mesh is None:
        graphdef, state = nnx.split(model)
        return generate_program(attn.placement.compiler_options)(graphdef, state, prompt, lengths, max_new_tokens,
                                                                 capacity, *split_attention(attn))
    logits, cache, attn = prefill(model, prompt, lengths, attn, capacity)
    tokens = _first_token(logits)
    out = [tokens]
    for _ in range(max_new_tokens - 1):
        tokens, _, cache = decode_step(model, tokens, cache, attn)
        out.append(tokens)
    return jnp.stack(out, axis=1)
