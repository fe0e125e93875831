"""What :func:`fathom_jax.models.generate` checks before any work: the rules the ``fathom`` CLI applies.

One entry, :func:`check_generate`: the prompt is a non-empty ``[T]`` or ``[B, T]`` array of integer token ids
inside the model's vocabulary; ``lengths`` (right-padded prompts) are integers in ``[1, T]``; prompt and new
tokens fit the cache and the model's ``max_position_embeddings`` (``allow_long_context=True`` runs past it, as
the CLI's ``--allow-long-context`` does); and the run's memory fits the machine's (the CLI's sizing,
:func:`fathom_jax.models.sizing.peak_bytes`, shared). A bad argument is a :class:`~fathom_jax.checks.CheckError`
naming it.
"""

from __future__ import annotations

import numpy as np

from fathom_jax.checks import CheckError
from fathom_jax.models import sizing


def _integers(name: str, values, want: str) -> np.ndarray:
    dtype = values.dtype if hasattr(values, "dtype") else np.asarray(values).dtype
    if np.asarray(values).size and not np.issubdtype(dtype, np.integer):
        raise CheckError(f"{name} must be integer {want}, got dtype {dtype}")
    return np.asarray(values)


def _check_prompt(prompt_ids, vocab: int) -> np.ndarray:
    prompt = _integers("prompt_ids", prompt_ids, "token ids")
    if prompt.ndim not in (1, 2) or prompt.shape[-1] == 0 or prompt.size == 0:
        raise CheckError(f"prompt_ids must be a non-empty [T] or [B, T] array of token ids, got shape "
                         f"{list(prompt.shape)}")
    outside = (prompt < 0) | (prompt >= vocab)
    if outside.any():
        where = tuple(int(i) for i in np.argwhere(outside)[0])
        raise CheckError(f"prompt_ids: token id {int(prompt[where])} at {list(where)} is outside the model's "
                         f"vocabulary [0, {vocab}) ({int(outside.sum())} such id(s))")
    return prompt.reshape(-1, prompt.shape[-1])


def _check_lengths(lengths, batch: int, tokens: int) -> int:
    """The longest prompt (``tokens`` when ``lengths`` is None)."""
    if lengths is None:
        return tokens
    lengths = _integers("lengths", lengths, f"prompt lengths [B] = [{batch}]")
    if lengths.shape != (batch,):
        raise CheckError(f"lengths must be [B] = [{batch}] (one per prompt), got shape {list(lengths.shape)}")
    if lengths.min() < 1 or lengths.max() > tokens:
        raise CheckError(f"lengths must lie in [1, {tokens}] (the prompt's {tokens} columns), got {lengths.tolist()}")
    return int(lengths.max())


def positions_message(tokens: int, limit: int | None, what: str, opt_in: str) -> str | None:
    """The error when ``tokens`` positions pass the model's ``limit`` (None: within it); ``opt_in`` names the way
    to go past it anyway."""
    if limit is None or tokens <= limit:
        return None
    return (f"{what} {tokens} tokens, more than the model's {limit} positions (max_position_embeddings); shorten "
            f"it, or pass {opt_in} to run past the trained length anyway")


def _memory_message(config, batch: int, tokens: int, *, itemsize: int, offloaded: bool) -> str | None:
    """The run against the memory it will use: on a CPU the CLI's sizing of the whole run (the weights are
    already loaded) against the machine's available memory; on an accelerator the KV cache against the device's
    free memory (an offloaded cache is sized by ``init_cache``'s pinned-memory check instead)."""
    import jax

    device = jax.devices()[0]
    what = f"generate over {tokens} tokens x {batch} prompt(s)"
    if device.platform == "cpu":
        need = sizing.peak_bytes(config, tokens, batch=batch, weights=False)
        return sizing.shortfall(need, what, sizing.available_bytes(), "memory_check=False")
    stats = device.memory_stats() or {}
    if offloaded or "bytes_limit" not in stats:
        return None
    need = 2 * itemsize * batch * config.n_layers * config.n_kv_heads * tokens * config.head_dim
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return sizing.shortfall(need, f"the KV cache of {what}", free, "memory_check=False")


def check_generate(model, prompt_ids, max_new_tokens: int, *, lengths=None, capacity: int | None = None,
                   allow_long_context: bool = False, memory_check: bool = True, offloaded: bool = False) -> None:
    """Every check of :func:`fathom_jax.models.generate`'s arguments, before any work (see the module docstring).

    ``capacity``: the cache's token capacity (None: the longest prompt + ``max_new_tokens``); ``offloaded``: the
    cache lives in host memory (its own check sizes it)."""
    config = model.config
    prompt = _check_prompt(prompt_ids, config.vocab)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise CheckError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    longest = _check_lengths(lengths, prompt.shape[0], prompt.shape[1])
    tokens = longest + int(max_new_tokens)
    if capacity is not None and tokens > capacity:
        raise CheckError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds cache capacity {capacity}")
    limit = getattr(config, "max_position_embeddings", None)
    message = None if allow_long_context else positions_message(
        tokens, limit, f"the prompt ({longest} tokens) + max_new_tokens {max_new_tokens} =", "allow_long_context=True")
    if message is None and memory_check:
        itemsize = np.dtype(getattr(model, "dtype", np.float32)).itemsize
        message = _memory_message(config, prompt.shape[0], max(tokens, capacity or 0), itemsize=itemsize,
                                  offloaded=offloaded)
    if message:
        raise CheckError(message)
