"""Test support: independent numpy references and small helpers shared by several test modules.

Shared *data* (the paper's worked example, random keys) are fixtures in ``conftest.py``; this module
holds functions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import calibrate as C
from fathom_jax import index as I
from fathom_jax import methods as M
from fathom_jax.models.config import LlamaConfig, RopeScaling
from fathom_jax.models.gemma3.config import Gemma3Config


def forced_logits(model, tokens, capacity: int | None = None, attention=None):
    """f32 logits ``[B, T, V]`` at every position of ``tokens [B, T]`` through the decoder protocol (the first
    token's prefill, then a decode step fed each next token: teacher forcing), and the decode state after them.
    ``attention``: the dense cache by default."""
    from fathom_jax.models import DenseCache, generation

    tokens = np.asarray(tokens, np.int32)
    b, t = tokens.shape
    attention = DenseCache() if attention is None else attention
    logits, state, attention = generation.prefill(model, tokens[:, :1], np.ones(b, np.int32), attention, capacity or t)
    out = [np.asarray(logits)]
    for i in range(1, t):
        _, logits, state = generation.decode_step(model, tokens[:, i], state, attention)
        out.append(np.asarray(logits))
    return np.stack(out, 1), state


# The tiny model's prompts (tests/models: `full_logits` is its teacher-forced logits, `tests/models/conftest.py`)
TINY_TOKENS = np.random.default_rng(0).integers(0, 97, (2, 12)).astype(np.int32)


def oracle_dir(owner: int | None = None) -> str:
    """The run's directory for the HF oracle's outputs (tests/models/conftest.py), keyed by the pid and
    start time of the process that owns the run: the pytest-xdist controller (the workers' parent) or a
    plain pytest. The workers share it, so an oracle runs once per run; the owner removes it at the end."""
    import os
    import tempfile

    owner = owner or (os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid())
    try:  # the start time tells a reused pid from the run that left a directory behind
        started = open(f"/proc/{owner}/stat").read().rsplit(")", 1)[1].split()[19]
    except OSError:
        started = "0"
    return os.path.join(tempfile.gettempdir(), f"fathom_oracle_{owner}_{started}")


_build_jit = jax.jit(I.build_index, static_argnums=(2,), static_argnames=("capacity",))


def build_index_jit(keys, calib, methods, **kw):
    """build_index of the methods' parts under jit (much faster to compile than op by op on CPU)."""
    return _build_jit(keys, calib, M.parts_of(methods), **kw)



def np_dequant(keys, depth, block=64):
    """Keys [n, D] read at per-channel depth [D] with 64-token fp16 absmax block scales."""
    keys = np.asarray(keys, np.float64)
    n, d = keys.shape
    depth = np.broadcast_to(np.asarray(depth), (d,))
    out = np.zeros_like(keys)
    for b0 in range(0, n, block):
        blk = keys[b0:b0 + block]
        a = np.abs(blk).max(0).astype(np.float16).astype(np.float64)
        cell = a / 8
        code = np.clip(np.floor(np.divide(blk, cell, out=np.zeros_like(blk), where=cell > 0)), -8, 7) + 8
        for j in range(d):
            t = int(depth[j])
            if t == 0:
                continue
            half = 2.0 ** (t - 1)
            out[b0:b0 + block, j] = ((code[:, j].astype(np.int64) >> (4 - t)) + 0.5 - half) * a[j] / half
    return out


def np_scales(keys, block=64):
    keys = np.asarray(keys, np.float64)
    out = np.zeros_like(keys)
    for b0 in range(0, keys.shape[0], block):
        out[b0:b0 + block] = np.abs(keys[b0:b0 + block]).max(0).astype(np.float16).astype(np.float64)
    return out


def top_set(row, k):
    return set(np.argsort(-np.asarray(row), kind="stable")[:k].tolist())


def random_setting(seed, n=192, d=16, g=4, hkv=1):
    rng = np.random.default_rng(seed)
    mix = np.linalg.qr(rng.standard_normal((d, d)))[0]
    keys = (rng.standard_normal((hkv, n, d)) * np.geomspace(3, 0.1, d)) @ mix + 0.5 * rng.standard_normal(d)
    queries = rng.standard_normal((hkv * g, 64, d)) * np.linspace(0.5, 2, d)
    calib = C.calibrate(keys.astype(np.float32), queries.astype(np.float32))
    q = rng.standard_normal((hkv, g, d)).astype(np.float32) * np.linspace(0.5, 2, d).astype(np.float32)
    return keys.astype(np.float32), q, calib


def np_codes(planes) -> np.ndarray:
    """4-bit codes ``[*B, n, D]`` of channel-major bit planes ``uint32 [*B, D, 4, W]`` (plane p holds bit 3 - p of
    the code, token t at bit t % 32 of word t // 32), in numpy: an independent reader for failure reports."""
    from tests.pallas_kernels.oracles import unpack_plane

    bits = np.apply_along_axis(unpack_plane, -1, np.asarray(planes, np.uint32))  # [*B, D, 4, n]
    codes = sum(bits[..., p, :] << (3 - p) for p in range(4))  # [*B, D, n]
    return np.swapaxes(codes, -1, -2)


def describe_code_difference(got_planes, want_planes, scales, keys, limit: int = 8) -> str:
    """Where two plane stores' codes differ, with what decides each cell: ``keys [n, D]`` (the store's basis),
    the fp16 block ``scales [D, NB]``, the cell width ``scale / 8`` and ``key / width`` in float64. Empty when
    the codes agree."""
    got, want = np_codes(got_planes), np_codes(want_planes)
    keys = np.asarray(keys, np.float32)
    n = keys.shape[0]
    diff = np.argwhere(got[:n] != want[:n])
    if not diff.size:
        return ""
    scales = np.asarray(scales, np.float16)
    lines = [f"{len(diff)} codes differ (token, channel): got != want"]
    for t, j in diff[:limit]:
        width = float(scales[j, t // 64]) / 8
        key = keys[t, j]
        lines.append(f"  ({t}, {j}): {got[t, j]} != {want[t, j]}; key {float(key)!r} (0x{key.view(np.uint32):08x}), "
                     f"scale {float(scales[j, t // 64])!r}, key / width {float(key) / width if width else float('nan')!r}")
    return "\n".join(lines)


def assert_trees_bitwise_equal(a, b):
    la, ta = jax.tree.flatten_with_path(a)
    lb, tb = jax.tree.flatten_with_path(b)
    assert ta == tb, (ta, tb)
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------------------------
# Proving a kernel ran


def count_pallas_calls(fn, *args, name: str, **kwargs) -> int:
    """How many ``pallas_call``s named ``name`` the jaxpr of ``fn(*args)`` holds."""
    return len(pallas_call_eqns(fn, *args, name=name, **kwargs))


def pallas_call_eqns(fn, *args, name: str, **kwargs) -> list:
    """The ``pallas_call`` equations named ``name`` (or a name starting with it) in the jaxpr of ``fn(*args)``, nested
    jaxprs included (their ``params`` hold e.g. the grid: ``params["grid_mapping"].grid``)."""
    return jaxpr_pallas_calls(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args), name)


def jaxpr_pallas_calls(jaxpr, name: str) -> list:
    """The ``pallas_call`` equations named ``name`` (or a name starting with it) in a closed jaxpr (e.g. a traced
    program's: a decode program compiled with XLA options cannot be traced inside another)."""
    return list(_named_calls(jaxpr.jaxpr, name))


def _named_calls(jaxpr, name: str):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            got = eqn.params.get("name")
            got = getattr(got, "name", got)
            if got == name or (isinstance(got, str) and got.startswith(name)):
                yield eqn
        for sub in _subjaxprs(eqn):
            yield from _named_calls(sub, name)


def jaxpr_equations(jaxpr, skip=()):
    """Every equation of ``jaxpr`` and the jaxprs nested in it (but inside the ``skip`` primitives')."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in skip:
            continue
        for v in eqn.params.values():
            for item in (v if isinstance(v, (tuple, list)) else (v,)):
                if hasattr(item, "eqns"):
                    yield from jaxpr_equations(item, skip)
                elif hasattr(item, "jaxpr") and hasattr(item, "consts"):
                    yield from jaxpr_equations(item.jaxpr, skip)


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(item, "jaxpr") and hasattr(item, "consts"):  # ClosedJaxpr
                yield item.jaxpr
            elif hasattr(item, "eqns"):  # Jaxpr
                yield item


def lower_triton_text(fn, *args, **kwargs) -> str:
    """Lower ``fn(*args)`` for CUDA with the Triton backend on a machine without a GPU (H200 target).

    Checks that a kernel lowers to Triton IR (a CPU-side test of everything but PTX compilation); returns
    the StableHLO text of the exported module.
    """
    from unittest import mock

    from jax._src.pallas.triton import gpu_info as gpu_info_lib

    info = gpu_info_lib.get_gpu_info_from_version(gpu_info_lib.GpuVersion.H200)
    with mock.patch.object(gpu_info_lib, "get_gpu_info", lambda: info):
        specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), args)
        exported = jax.export.export(
            jax.jit(lambda *a: fn(*a, **kwargs)), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*specs)
    return exported.mlir_module()


def serve_first_layers(monkeypatch, n_layers: int) -> None:
    """``hub.load_model`` (and so ``load_smollm2``) hands out SmolLM2 cut to its first ``n_layers`` layers: its own
    weights, tokenizer and config but ``n_layers``, so examples and notebooks run the real model's calls, shapes and
    cache layouts at a fraction of the compute. Other models load as they are."""
    import dataclasses

    from flax import nnx

    from fathom_jax.models import hub
    from fathom_jax.models.llama import LlamaForCausalLM

    load = hub.load_model
    model, tokenizer, config = load("smollm2")
    config = dataclasses.replace(config, n_layers=n_layers)
    first = nnx.eval_shape(lambda: LlamaForCausalLM(config, dtype=model.dtype))
    nnx.update(first, jax.tree_util.tree_map_with_path(
        lambda p, a: a[:n_layers] if p[0].key == "layers" else a, nnx.state(model)))

    def load_first(source=None, *, dtype="float32"):
        if source in (None, "smollm2") and dtype == "float32":
            return first, tokenizer, config
        return load(source, dtype=dtype)

    monkeypatch.setattr(hub, "load_model", load_first)


def bench_offload_rows(tmp_path, monkeypatch, tag: str, *args: str):
    """``scripts.bench_offload`` run on the CPU at tiny shapes with the benchmark's head_dim 128 (2 layers, 4 heads),
    XLA kernels, one 128-token context, Fathom 48 at k = 64, one step, plus ``args``: ``(results, config)``, the run
    checked to have recorded no error."""
    import dataclasses
    import json

    from scripts import bench_offload

    cfg = dataclasses.replace(bench_offload.SMOKE, head_dim=128, n_heads=4, n_layers=2)
    monkeypatch.setattr(bench_offload, "SMOKE", cfg)
    bench_offload.main(["--smoke", "--implementation", "xla", "--out", str(tmp_path), "--tag", tag, "--contexts", "128",
                        "--methods", "Fathom 48", "--k", "64", "--steps", "1", "--repeats", "1",
                        "--share-kv-from", "none", *args])
    with open(offload_file(tmp_path, tag, "json")) as f:
        res = json.load(f)
    assert not res["errors"], res["errors"]
    return res, cfg


def offload_file(folder, tag: str, ext: str):
    """The file ``scripts.bench_offload --tag TAG`` writes into ``folder`` on this machine: ``offload_cpu_TAG.EXT`` on
    the CPU (the prefix names the device the run used)."""
    from scripts import harness

    return folder / f"offload_{harness.machine_name()}_{tag}.{ext}"


# Marks of a test that needs a CUDA GPU
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]


def corpus_calibration(model, seed):
    """A calibration from the q/k/v ``model`` captures over 64 random tokens (``seed``)."""
    from fathom_jax.models import capture_qkv

    cap = capture_qkv(model, np.random.default_rng(seed).integers(0, 97, 64))
    return C.calibrate(cap["k"], cap["q"])


def sparse_forced(model, prompt, tokens, attn, capacity=48, lengths=None):
    """Teacher forcing through ``attn`` (tests/decode/test_hook.py's capacity 48 by default): the prefill of
    ``prompt`` [B, T], then decode steps fed ``tokens`` [B, steps]: (logits [steps + 1, B, V], final cache, hook
    after prefill)."""
    from fathom_jax.models import generation

    lengths = np.full(prompt.shape[0], prompt.shape[1]) if lengths is None else lengths
    logits, cache, attn = generation.prefill(model, prompt, lengths, attn, capacity)
    out = [np.asarray(logits)]
    for t in range(tokens.shape[1]):
        _, logits, cache = generation.decode_step(model, tokens[:, t], cache, attn)
        out.append(np.asarray(logits))
    return np.stack(out), cache, attn


# A tiny Gemma 3 (tests/models/test_gemma3.py's): two blocks of (2 local, 1 global) layers; window 4 < its 13 tokens;
# 4 query heads over 2 KV heads; query_pre_attn_scalar != head_dim, softcapped logits, linear RoPE scaling on the
# global layers. (The tail of local layers after the last global one is in test_gemma3.py's transformers parity case.)
TINY_GEMMA3 = Gemma3Config(vocab=97, hidden=32, intermediate=48, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=8,
                           sliding_window=4, sliding_window_pattern=3, query_pre_attn_scalar=6.0,
                           final_logit_softcapping=8.0, rope_scaling=RopeScaling("linear", 2.0))


# SmolLM2-135M's shape: what argument checks need from a model (its metadata), without loading it.
SMOL = LlamaConfig(vocab=49152, hidden=576, intermediate=1536, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                   tie_word_embeddings=True, max_position_embeddings=8192)


class CharTokenizer:
    """One token per character: prompt lengths are easy to control."""

    def encode(self, text):
        return [ord(c) % 97 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def write_hf_checkpoint(path, seed=0):
    """A tiny random Llama written in HF layout by our own name map (no transformers needed)."""
    import json
    import os

    from flax import nnx
    from safetensors.numpy import save_file

    from fathom_jax.models import LlamaConfig, LlamaForCausalLM
    from fathom_jax.models.llama.loading import hf_name_map

    cfg = LlamaConfig(vocab=50, hidden=16, intermediate=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 50, "hidden_size": 16, "intermediate_size": 24,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "tie_word_embeddings": False}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    tensors = {}
    for p, var in nnx.to_flat_state(nnx.state(model)):
        spec = hf_name_map(cfg)[tuple(p)]
        a = np.asarray(var.get_value())
        for i, layer_a in enumerate(a if p[0] == "layers" else [a]):
            tensors[spec.name.format(i=i)] = np.ascontiguousarray(spec.transform(layer_a))  # T is self-inverse
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return model, cfg


def scores_sequence(steps=40, heads=3, n=448, seed=0):
    """Scores [P, H, n] of drifting heads whose scale and offset jump now and then (both failures occur)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((heads, n))
    out = []
    scale, offset = np.ones(heads), np.zeros(heads)
    for _ in range(steps):
        base = 0.9 * base + np.sqrt(1 - 0.81) * rng.standard_normal(base.shape)
        jump = rng.random(heads) < 0.25
        scale = np.where(jump, rng.uniform(0.3, 3.0, heads), scale)
        offset = np.where(jump, rng.normal(0, 1.5, heads), offset)
        out.append(scale[:, None] * base + offset[:, None])
    return np.asarray(out, np.float32)
