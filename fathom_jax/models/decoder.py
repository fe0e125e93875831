"""The decoder protocol: what the generation drivers (:mod:`~fathom_jax.models.generation`: ``generate``,
``prefill``, ``decode_step``, ``decode_loop``) and q/k/v capture (:mod:`~fathom_jax.models.capture`) use of a model.

A family is a Flax NNX module that implements :class:`Decoder` (and :class:`LayerwiseDecoder` where a prompt can run
one layer per program): its layers in one layer scan, each layer's attention handed to an attention object with a
cache of its own (:mod:`~fathom_jax.models.attention`): the dense cache, sparse decoding, or a capture. The decode
state is that cache with whatever the model keeps of its own between steps (Gemma 3: its sliding windows);
``split_state`` / ``join_state`` take the two apart, since the attention makes the programs over its cache and the
model's own part travels beside it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jaxtyping import Array, Float, Int

from fathom_jax.models.attention import CacheAttention, CacheShape, PromptAttention


@runtime_checkable
class Decoder(Protocol):
    """A decoder-only LM as the drivers run it.

    ``config``: the frozen, hashable config (``vocab``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``,
    ``group_size``, ``max_position_embeddings``, ... of :class:`~fathom_jax.models.config.DecoderConfig`); ``dtype``:
    the weights' and cache's dtype; ``ragged``: sequences of different lengths decode together (where the attention
    allows it); ``capture_query_chunk``: queries per chunk of q/k/v capture's exact attention (None: all at once),
    each family's own so that captures stay bit-identical to the ones the studies committed.
    """

    config: Any
    dtype: Any
    ragged: bool
    capture_query_chunk: int | None

    def cache_shape(self, batch: int, capacity: int) -> CacheShape:
        """The shape of the attention's cache: the layers whose attention it runs (Gemma 3: the global ones)."""

    def init_state(self, attention: PromptAttention, batch: int, capacity: int) -> Any:
        """An empty decode state: the attention's empty cache and the model's own part."""

    def split_state(self, state) -> tuple[Any, Any]:
        """``(own, cache)``: what the model keeps between steps (None if nothing) and the attention's cache. An ``own``
        that is not None has a ``sequence_axes()`` method: a tree like it of each leaf's sequence (batch) axis, what
        moves one sequence's state without knowing its layout (a session pool's slots)."""

    def join_state(self, own, cache) -> Any:
        """The decode state of ``own`` and ``cache`` (the inverse of :meth:`split_state`)."""

    def forward_prompt(self, attention: PromptAttention, prompt: Int[Array, "B T"], lengths: Int[Array, "B"],
                       state) -> tuple[Float[Array, "B V"], Any]:
        """The right-padded prompt (``lengths [B]``) through every layer in one program: ``(f32 logits at each last
        prompt token [B, V], state)``; each layer's attention is ``attention.attend_prompt``."""

    def forward_token(self, attention: CacheAttention, tokens: Int[Array, "B"], state
                      ) -> tuple[Float[Array, "B V"], Any]:
        """One decode step of every sequence at its own position: ``(f32 logits [B, V], state)``. Each layer calls
        ``attention.attend`` inside the layer scan; ``attention.commit`` runs once after it."""


@runtime_checkable
class LayerwiseDecoder(Decoder, Protocol):
    """A decoder whose prompt can run one layer per program (the streaming prefill of an offloaded cache: one layer's
    activations at a time). The state is the attention's cache alone."""

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        """The hidden states entering the first layer."""

    def prompt_layer(self, attention: PromptAttention, h: Float[Array, "B T E"], lengths: Int[Array, "B"], cache,
                     layer: Int[Array, ""]) -> tuple[Float[Array, "B T E"], Any]:
        """Layer ``layer`` of the prompt: ``(the next hidden states, the cache with this layer's rows written)``."""

    def last_logits(self, h: Float[Array, "B T E"], lengths: Int[Array, "B"]) -> Float[Array, "B V"]:
        """f32 logits at each sequence's last prompt token, from the last layer's hidden states."""
