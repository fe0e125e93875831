"""Quest (Tang et al. 2024): the fp16 per-channel min and max key of every P-token page, scored by its upper bound."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from fathom_jax import format as fmt
from fathom_jax.format import QUEST_PAGE_TOKENS
from fathom_jax.index.page_bounds import check_page
from fathom_jax.index.parts import PageBounds
from fathom_jax.methods.base import BlockRead, ScanMethod, parse_int


@dataclasses.dataclass(frozen=True)
class Quest(ScanMethod):
    """Every token gets its page's score ``sum_j max(q_j min_j, q_j max_j)``, the largest ``q . k`` the page's
    per-channel bounds allow (Quest's criticality estimate); ``2 x 16 D / P`` bits per token. Pages of ``page``
    tokens (default 16, the Quest paper's); the bounds are over the page's valid tokens, stored as fp16 rounded to
    nearest (as the landmark means are), not outward, so a bound may sit a half fp16 step inside the keys; ties inside
    a page are left to the selection (lower positions first). Selection is per token, as for every method here (the
    paper selects whole pages)."""

    page: int = QUEST_PAGE_TOKENS

    name: ClassVar[str] = "quest"
    spec_syntax: ClassVar[str] = "quest[:P]"
    summary: ClassVar[str] = "fp16 min and max key of every P-token page (Quest; default P = 16)"

    def __post_init__(self):
        check_page(self.page, "Quest")

    @property
    def parts(self) -> frozenset[PageBounds]:  # type: ignore[override]
        return frozenset({PageBounds(self.page)})

    @property
    def label(self) -> str:
        return f"Quest P={self.page}"

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.page}"

    @classmethod
    def from_spec_args(cls, args, spec):
        if len(args) > 1:
            raise ValueError(f"bad method spec {spec!r}: expected {cls.spec_syntax}")
        return cls(parse_int(args[0], "page", spec)) if args else cls()

    def fixed_bits_per_token(self, head_dim: int) -> float:
        return fmt.quest_bits_per_token(head_dim, self.page)

    def read(self, q, index, calib, *, implementation=None):
        bits = jnp.full(q.shape[:-2], self.fixed_bits_per_token(q.shape[-1]), jnp.float32)
        split = jnp.concatenate([jnp.minimum(q, 0.0), jnp.maximum(q, 0.0)], axis=-1)  # against [min | max]
        return BlockRead(split, bits, part=PageBounds(self.page).name, block=self.page)
