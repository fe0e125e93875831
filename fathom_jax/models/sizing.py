"""Whether a run fits the machine: the one sizing of a run's memory that the CLI and :func:`fathom_jax.models.generate`
share (what a config's weights, caches and prefill take; what the machine has available).
"""

from __future__ import annotations

from fathom_jax.models import families

GiB = 1 << 30


def param_count(config) -> int:
    d, h, hkv, hid = config.head_dim, config.n_heads, config.n_kv_heads, config.hidden
    per_layer = 2 * hid * h * d + 2 * hid * hkv * d + 3 * hid * config.intermediate + 2 * hid
    embeddings = config.vocab * hid * (1 if config.tie_word_embeddings else 2)
    return config.n_layers * per_layer + embeddings + hid


def cache_layers(config) -> tuple[int, int, int]:
    """``(layers that cache the whole context, layers that cache a window, the window)``, as the config's family
    (``families.py``) counts them: Gemma 3's global and sliding-window layers; every layer of a Llama-family model
    caches the whole context."""
    return families.for_config(config).cache_layers(config)


def peak_bytes(config, tokens: int, *, capture_texts: int = 0, batch: int = 1, weights: bool = True,
               cache: int | None = None) -> int:
    """A sizing of the largest allocation of a run at ``tokens`` tokens (f32 on the CPU).

    Prefill materialises one layer's attention scores, exponentials and probabilities ([batch, heads, T, T] f32
    each; Gemma 3 attends by chunks of queries: [batch, heads, chunk, T]); the weights are held twice while a GGUF
    is dequantized (``weights=False``: a model already loaded); the decode state (``cache`` bytes, default the
    dense cache of the layers that cache the whole context and the sliding windows), and for the study the
    captured q/k/v of those layers for each text, come on top.
    """
    from fathom_jax.models.prompt_attention import PREFILL_QUERY_CHUNK  # (imports jax: the CLI starts without)

    full, local, window = cache_layers(config)
    held = 2 * 4 * param_count(config) if weights else 0
    query_rows = min(tokens, PREFILL_QUERY_CHUNK) if families.for_config(config).chunked_prefill else tokens
    scores = 3 * 4 * batch * config.n_heads * query_rows * tokens
    if cache is None:
        cache = 2 * 4 * batch * config.n_kv_heads * config.head_dim * (full * tokens + local * window)
    captured = capture_texts * 4 * full * (config.n_heads + 2 * config.n_kv_heads) * tokens * config.head_dim
    return held + scores + cache + captured


def available_bytes() -> int | None:
    """The machine's available memory (``MemAvailable``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def shortfall(need: int, what: str, available: int | None, opt_out: str) -> str | None:
    """The message when ``need`` bytes exceed ``available`` (None: it fits, or nothing is known); ``opt_out``
    names the way to try anyway (the CLI's flag, or generate's keyword)."""
    if available is None or need <= available:
        return None
    return (f"{what} needs about {need / GiB:.1f} GiB of memory and {available / GiB:.1f} GiB is available; use "
            f"fewer tokens (or pass {opt_out} to try anyway)")
