"""scripts/soak.py on a tiny random decoder (CPU): the index check from the keys the soak keeps, with rows in the
model dtype and compressed (k8v8), passes, and finds a changed block."""

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scripts import soak


class Tokens:
    """A tokenizer of the tiny decoder's vocabulary (characters modulo it)."""

    def __init__(self, vocab):
        self.vocab = vocab

    def encode(self, text):
        return [ord(c) % self.vocab for c in text]


def args(**kw):
    # 93 + 35 = 128: the first check lands on a block boundary, where the store's tail is a full block's scratch
    base = dict(steps=70, check_every=35, prompt_tokens=93, method="fathom:32", k=40, rows="model")
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize("rows", ["k8v8"])  # model rows: the same checks and the rebuild from the rows (on the GPU)
def test_soak_checks_the_index_against_the_models_keys(rows, tiny_model, tiny_config, tmp_path):
    res = soak.soak(tiny_model, Tokens(tiny_config.vocab), args(rows=rows))
    assert res["rows"] == rows and res["passed"], res
    assert [c["step"] for c in res["checks"]] == [35, 70] and res["kept_keys_from"] == 64
    assert all(c["index_equals_rebuild"] and c["programs"] == 1 for c in res["checks"])
    d = tiny_config.head_dim
    row_bytes = 2 * d * 4 if rows == "model" else 2 * (d + 2)  # f32 K and V; or 8-bit codes + fp16 scale each
    assert res["row_bytes_per_token"] == row_bytes
    assert res["host_bytes_per_token"] == pytest.approx(row_bytes + 4 * d / 8 + 2 * d / 64)
    out = {"machine": {"date": "2026-12-02", "device": "cpu", "jax": jax.__version__, "commit": "abc"},
           "command": "soak", "soak": res}
    soak.write_report(json.loads(json.dumps(out)), str(tmp_path / "soak"))
    assert f"K/V rows: `{rows}`" in (tmp_path / "soak.md").read_text()


def test_keylog_finds_a_changed_block_and_a_changed_row(tiny_model, tiny_config):
    from fathom_jax import decode
    from fathom_jax.models import generation

    prompt = np.arange(100, dtype=np.int32)[None] % tiny_config.vocab
    attn = decode.from_spec("fathom:32", k=40, placement="pinned_host", rows="k8v8")
    logits, cache, attn = generation.prefill(tiny_model, prompt, np.array([100]), attn, 300)
    log = soak.KeyLog(cache, 40)
    tokens = jnp.argmax(logits, -1).astype(jnp.int32)
    for _ in range(40):
        tokens, _, cache = generation.decode_step(tiny_model, tokens, cache, attn)
        log.after_step(cache)
    assert log.check(cache, attn) == (True, "")
    host = jax.device_get(cache)
    store = host.index.data[log.part]

    def changed(**kw):
        data = list(host.index.data)
        data[log.part] = dataclasses.replace(store, **kw)
        return dataclasses.replace(host, index=dataclasses.replace(host.index, data=tuple(data)))

    planes = np.array(store.planes)
    planes[2, 1, 3, 0, 2] ^= 1  # layer 2, the block of tokens 64-127 (decoded)
    ok, where = log.check(cache, attn, changed(planes=planes))
    assert not ok and where.startswith("layer 2, planes")
    planes = np.array(store.planes)
    planes[0, 0, 0, 0, 1] ^= 1  # the prompt's first block
    assert log.check(cache, attn, changed(planes=planes)) == (False, "the prompt's blocks changed since the prefill")
    kv = np.array(host.kv)
    kv[1, 0, 120, 0] ^= 1 << 8  # a K code of token 120
    assert log.check(cache, attn, dataclasses.replace(host, kv=kv)) == (False, "K rows differ from the kept keys encoded")
