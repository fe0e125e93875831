"""One process of a multi-process sparse decode (tests/test_distributed.py starts two on this machine).

    JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \\
        python -m tests.distributed_worker --model smollm2-layout --methods fathom:16,sparq:4 --mesh 4

Every process loads the model once, builds the global mesh, and for each method prefills the same batch into a cache
placed in the host layout (``pinned_host``), decodes greedily, and prints one line ``RESULT {json}``: the tokens (on
every process), the cache's global bytes and the bytes of the shards this process holds. ``--die-after-prefill I``:
process ``I`` exits abruptly after the first prefill (the others must fail, not hang). The same functions decode
the reference on one device in the test's own process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

MODELS = ("tiny", "smollm2-layout", "smollm2")
# SmolLM2 (the real weights, or random ones in its attention layout): 4 sequences x 3 KV heads = 12 groups, 3 per
# device of a 4-device mesh. Prompts of 10-21 tokens and k = 5 (1 sink + 2 local + the top 2 by approximate score)
# leave the scan and the selection something to choose.
SMOL_PROMPTS = ("def add(a, b):\n    return a + b\n\ndef", "The capital of France is Paris. The capital of Italy is",
                "import numpy as np\nx = np.zeros((3, 4))\nprint(x.", "Once upon a time there was a little fox who")
K, SINK, LOCAL = 5, 1, 2
NEW_TOKENS = 4
DIED = 3  # the exit status of the process told to die


def load(name: str):
    """``(model, prompt [B, T], lengths [B])`` of ``name``: the same on every process."""
    if name == "smollm2":
        from fathom_jax.models import hub

        model, tok, _ = hub.load_smollm2()
        ids = [tok.encode(text) for text in SMOL_PROMPTS]
    else:
        from flax import nnx

        from fathom_jax.models import LlamaForCausalLM
        from fathom_jax.models.config import LlamaConfig

        rng = np.random.default_rng(5)
        if name == "smollm2-layout":  # random weights in SmolLM2's attention layout: 9 heads over 3 KV heads, D = 64
            cfg = LlamaConfig(vocab=256, hidden=96, intermediate=128, n_layers=2, n_heads=9, n_kv_heads=3,
                              head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5)
            lengths = (15, 12, 21, 10)  # SMOL_PROMPTS' token counts: 4 sequences x 3 KV heads = 12 groups
        else:
            cfg = LlamaConfig(vocab=97, hidden=32, intermediate=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8,
                              rope_theta=1e4, rms_norm_eps=1e-6, attention_bias=True, qk_norm=True)
            lengths = (14, 11)  # 2 sequences x 2 KV heads = 4 groups
        model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
        ids = [rng.integers(0, cfg.vocab, n).tolist() for n in lengths]
    prompt = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for row, seq in zip(prompt, ids):
        row[: len(seq)] = seq
    return model, prompt, np.array([len(seq) for seq in ids], np.int32)


def hook(spec: str, placement):
    from fathom_jax import decode

    return decode.from_spec(spec, k=K, sink=SINK, local=LOCAL, placement=placement)


def placed_cache(attn, model, prompt) -> dict:
    """Where an empty cache of ``attn`` for this batch lives (allocated, not filled): its bulk bytes over all
    processes, the bytes of this process's shards, and the shapes of its K/V shards."""
    from fathom_jax import distributed
    from fathom_jax.models.attention import CacheShape
    from fathom_jax.placement import split_bulk

    cfg = model.config
    shape = CacheShape(layers=cfg.n_layers, batch=prompt.shape[0], kv_heads=cfg.n_kv_heads, capacity=capacity(prompt),
                       head_dim=cfg.head_dim, dtype=model.dtype)
    cache = attn.bind(shape).init_cache(shape)
    return {"bytes": sum(cache.nbytes().values()), "local_shards": attn.placement.local_shards,
            "local_bytes": distributed.local_bytes(split_bulk(cache, cache.bulk())[1]),
            "kv_spans_processes": not cache.kv.is_fully_addressable,
            "kv_shard_shapes": [list(s.data.shape) for s in cache.kv.addressable_shards]}


def capacity(prompt) -> int:
    return prompt.shape[1] + NEW_TOKENS


def decode_tokens(model, prompt, lengths, attn) -> np.ndarray:
    """Greedy decoding of NEW_TOKENS per sequence (``fathom_jax.models.generate``): tokens [B, NEW_TOKENS] on every
    process."""
    from fathom_jax import distributed
    from fathom_jax.models import generate

    out = generate(model, prompt, NEW_TOKENS, capacity=capacity(prompt), lengths=lengths, attention_fn=attn)
    return distributed.to_host(out)


def die_mid_run(model, prompt, lengths, attn, dying: int) -> np.ndarray:
    """Every process prefills (programs that span them all); then process ``dying`` exits abruptly, as a crashed host
    would, and the others decode (their first step waits on the dead one)."""
    import jax

    from fathom_jax import distributed
    from fathom_jax.models import generation

    logits, cache, attn = generation.prefill(model, prompt, lengths, attn, capacity(prompt))
    jax.block_until_ready((logits, cache))
    if jax.process_index() == dying:
        print(f"process {dying}: exiting after the prefill", file=sys.stderr, flush=True)
        os._exit(DIED)
    tokens, _ = generation.decode_loop(model, generation.first_token(logits), cache, attn, NEW_TOKENS)
    return distributed.to_host(tokens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=MODELS, default="tiny")
    ap.add_argument("--methods", default="fathom:16,sparq:4")
    ap.add_argument("--mesh", type=int, default=4, help="devices of the global mesh")
    ap.add_argument("--die-after-prefill", type=int, default=None, metavar="PROCESS")
    ap.add_argument("--heartbeat-timeout", type=int, default=None, help="seconds (default: the library's)")
    args = ap.parse_args(argv)
    t0 = time.time()
    from fathom_jax import distributed

    kw = {} if args.heartbeat_timeout is None else {"heartbeat_timeout_s": args.heartbeat_timeout}
    distributed.initialize(**kw)
    import jax
    from flax import nnx

    from fathom_jax.placement import Placement, device_mesh

    print(distributed.describe(), file=sys.stderr, flush=True)
    model, prompt, lengths = load(args.model)
    distributed.check_same(prompt, "the prompt's token ids")
    placement = Placement("pinned_host", mesh=device_mesh(args.mesh))
    nnx.update(model, placement.replicate(nnx.state(model)))  # the weights on every device, once
    loaded = time.time() - t0
    for spec in args.methods.split(","):
        t = time.time()
        attn = hook(spec, placement)
        if args.die_after_prefill is not None:
            tokens, facts = die_mid_run(model, prompt, lengths, attn, args.die_after_prefill), {}
        else:
            facts = placed_cache(attn, model, prompt)
            tokens = decode_tokens(model, prompt, lengths, attn)
        print("RESULT " + json.dumps({"method": spec, "process": jax.process_index(), "tokens": tokens.tolist(),
                                      **facts, "seconds": round(time.time() - t, 1), "load_s": round(loaded, 1)}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
