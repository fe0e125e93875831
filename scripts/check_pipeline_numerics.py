"""Which offloaded variant moves SmolLM2's logits: 32 greedy steps at 4k, each against the in-HBM decode.

Run on the GPU machine with the SmolLM2 GGUF in $FATHOM_CACHE (seventh session, 2026-11-30, one H200:
``results/logs/smol_variants_h200.log``; that run used a copy with the unused ``sys`` import). One chunk (with or without persistent gather programs and the CONCURRENT
command-buffer option) equals HBM exactly; three pipelined chunks give the same tokens with logits off by float
reassociation (see ``results/pipeline_h200.md``).
"""
import time

import jax.numpy as jnp
import numpy as np

from fathom_jax import decode
from fathom_jax.eval import texts
from fathom_jax.models import sparse
from fathom_jax.models.hub import load_smollm2

model, tok, cfg = load_smollm2()
text, _ = texts.evaluation_text()
ids = np.asarray(texts.token_window(tok.encode(text), 4096 - 64), np.int32)[None]
lengths = np.array([ids.shape[1]])
P = decode.Placement
variants = {"device": "device",
            "host p1 g0 (old default)": P("pinned_host", pipeline=1, gather_programs=0),
            "host p1 g66": P("pinned_host", pipeline=1, gather_programs=66),
            "host auto (p1 g66 + CONCURRENT)": P("pinned_host"),
            "host p3 g66 + CONCURRENT": P("pinned_host", pipeline=3)}
out = {}
for name, placement in variants.items():
    t = time.time()
    attn = decode.from_spec("fathom:32", k=128, placement=placement, implementation="pallas")
    logits, cache, attn = sparse.prefill(model, ids, lengths, attn, 4096)
    toks, all_logits = [jnp.argmax(logits, -1).astype(jnp.int32)], [np.asarray(logits)]
    for _ in range(31):
        nxt, logits, cache = sparse.decode_step(model, toks[-1], cache, attn)
        toks.append(nxt)
        all_logits.append(np.asarray(logits))
    out[name] = (np.asarray(jnp.stack(toks, 1)), np.stack(all_logits))
    ref = out["device"]
    diff = np.abs(out[name][1] - ref[1]).max(axis=(1, 2))
    print(f"{name}: tokens equal {np.array_equal(out[name][0], ref[0])}, max |dlogit| per step {np.round(diff, 5).tolist()}"
          f" (scale {np.abs(ref[1]).max():.1f}) {time.time() - t:.0f}s", flush=True)
