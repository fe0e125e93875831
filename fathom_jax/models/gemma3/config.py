"""Gemma 3 (text) configuration: interleaved sliding-window ("local") and global attention layers.

The sizes are :class:`~fathom_jax.models.config.DecoderConfig`'s, as :class:`~fathom_jax.models.LlamaConfig`'s are,
and other field names follow it wherever the meaning is the same (``max_position_embeddings``, ...).
Values come from a GGUF's metadata (:func:`config_from_gguf`) or a HF ``config.json`` (:func:`from_hf_dict`);
what neither file states takes transformers' ``Gemma3TextConfig`` default, which llama.cpp hard-codes too
(the local layers' RoPE base 10000, one global layer in every six).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from fathom_jax.models.config import DecoderConfig, RopeScaling, gguf_field


@dataclasses.dataclass(frozen=True)
class Gemma3Config(DecoderConfig):
    """Layer ``i`` is global iff ``(i + 1) % sliding_window_pattern == 0`` (transformers' ``layer_types``);
    every other layer attends to the last ``sliding_window`` positions, itself included."""

    sliding_window: int = 512
    sliding_window_pattern: int = 6
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_theta: float = 10_000.0  # sliding-window layers
    rope_scaling: RopeScaling | None = None  # global layers only ("linear"), as in transformers and llama.cpp
    query_pre_attn_scalar: float = 256.0  # attention logits are (q . k) * query_pre_attn_scalar ** -0.5
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    family: str = "gemma3"

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window < 1 or self.sliding_window_pattern < 1:
            raise ValueError(f"sliding_window={self.sliding_window} and sliding_window_pattern="
                             f"{self.sliding_window_pattern} must be >= 1")
        if self.n_layers < self.sliding_window_pattern:
            raise ValueError(f"n_layers={self.n_layers} holds no global layer (one in every "
                             f"{self.sliding_window_pattern})")
        if not self.tie_word_embeddings:
            raise ValueError("Gemma 3 ties its output projection to the embedding; untied weights are not supported")
        if self.rope_scaling is not None and self.rope_scaling.rope_type != "linear":
            raise ValueError(f"unsupported rope scaling {self.rope_scaling.rope_type!r} for Gemma 3 (only 'linear')")

    @property
    def n_blocks(self) -> int:
        """Repeats of the pattern (``sliding_window_pattern - 1`` local layers, then one global)."""
        return self.n_layers // self.sliding_window_pattern

    @property
    def n_tail(self) -> int:
        """Local layers after the last global layer (Gemma 3 1B: 26 = 4 x 6 + 2)."""
        return self.n_layers % self.sliding_window_pattern

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Model layer index of each global layer; the attention hook's ``layer`` is a position in this tuple."""
        p = self.sliding_window_pattern
        return tuple(range(p - 1, self.n_layers, p))

    @property
    def local_layers(self) -> tuple[int, ...]:
        """Model layer index of each sliding-window layer, in order."""
        return tuple(i for i in range(self.n_layers) if i not in set(self.global_layers))

    @property
    def layer_types(self) -> tuple[str, ...]:
        """transformers' names, layer by layer."""
        g = set(self.global_layers)
        return tuple("full_attention" if i in g else "sliding_attention" for i in range(self.n_layers))

    @property
    def query_scale(self) -> float:
        """Factor on the post-RoPE query so that ``(q . k) / sqrt(head_dim)`` is the attention logit (what
        the attention objects compute); exactly 1.0 when query_pre_attn_scalar == head_dim."""
        return math.sqrt(self.head_dim) / math.sqrt(self.query_pre_attn_scalar)


def config_from_gguf(reader) -> Gemma3Config:
    """From a ``gguf.GGUFReader`` whose ``general.architecture`` is "gemma3" (llama.cpp's key names)."""
    arch = gguf_field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"expected a 'gemma3' GGUF, got architecture {arch!r}")
    g = lambda k, d=None: gguf_field(reader, f"gemma3.{k}", d)  # noqa: E731
    hidden, n_heads, n_layers = int(g("embedding_length")), int(g("attention.head_count")), int(g("block_count"))
    head_dim = int(g("attention.key_length", 256))
    if int(g("attention.value_length", head_dim)) != head_dim:
        raise ValueError("Gemma 3 GGUF with value_length != key_length is not supported")
    scaling = None
    if g("rope.scaling.type") not in (None, "none"):
        if g("rope.scaling.type") != "linear":
            raise ValueError(f"unsupported GGUF rope scaling {g('rope.scaling.type')!r} (only 'linear')")
        scaling = RopeScaling("linear", float(g("rope.scaling.factor")))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cap = g("final_logit_softcapping")
    return Gemma3Config(
        vocab=int(vocab),
        hidden=hidden,
        intermediate=int(g("feed_forward_length")),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        sliding_window=int(g("attention.sliding_window", 512)),
        rope_theta=float(g("rope.freq_base", 1_000_000.0)),
        rope_scaling=scaling,
        # llama.cpp: 1/sqrt(head_dim) but for the 27B model (62 blocks), 1/sqrt(hidden / heads); transformers'
        # GGUF loader keeps its default of 256, the 270M..12B models' head_dim.
        query_pre_attn_scalar=float(hidden // n_heads if n_layers == 62 else head_dim),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        final_logit_softcapping=None if cap is None else float(cap),
        max_position_embeddings=int(g("context_length", 32768)),
        tie_word_embeddings="output.weight" not in names,
    )


def from_hf_dict(d: Mapping[str, Any]) -> Gemma3Config:
    """From a HF ``config.json`` dict of a ``Gemma3ForCausalLM`` (model_type "gemma3_text"), transformers 4.x
    (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``) or 5.x (``rope_parameters`` per layer type)."""
    d = dict(d)
    if d.get("model_type") != "gemma3_text":
        raise ValueError(f"expected model_type 'gemma3_text', got {d.get('model_type')!r}")
    for key, want in (("hidden_activation", "gelu_pytorch_tanh"), ("attention_bias", False),
                      ("attn_logit_softcapping", None), ("use_bidirectional_attention", False)):
        if d.get(key, want) != want:
            raise ValueError(f"gemma3: {key}={d[key]!r} is not supported (only {want!r})")
    types = d.get("layer_types")
    if types is not None and "full_attention" not in types:
        raise ValueError("gemma3: layer_types has no full_attention layer")
    pattern = types.index("full_attention") + 1 if types is not None else int(
        d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
    params = d.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {}, **(d.get("rope_scaling") or {}))
    local = params.get("sliding_attention") or {}
    scaling = None
    if full.get("rope_type", full.get("type", "default")) != "default":
        scaling = RopeScaling(full.get("rope_type", full.get("type")), float(full["factor"]))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"gemma3: rope scaling on the sliding-window layers ({local}) is not supported")
    n_heads = int(d.get("num_attention_heads", 8))
    cfg = Gemma3Config(
        vocab=int(d.get("vocab_size", 262_208)),
        hidden=int(d.get("hidden_size", 2304)),
        intermediate=int(d.get("intermediate_size", 9216)),
        n_layers=int(d.get("num_hidden_layers", 26)),
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads", 4)),
        head_dim=int(d.get("head_dim", 256)),
        sliding_window=int(d.get("sliding_window", 4096)),
        sliding_window_pattern=pattern,
        rope_theta=float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
        rope_local_theta=float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))),
        rope_scaling=scaling,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        max_position_embeddings=int(d.get("max_position_embeddings", 131_072)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
    )
    if types is not None and tuple(types) != cfg.layer_types:
        raise ValueError(f"gemma3: layer_types {types} are not one global layer in every {pattern}")
    return cfg
