"""Tokenizers: HF `tokenizer.json`, or a GPT-2-style byte-level BPE rebuilt from GGUF metadata."""

from __future__ import annotations

import dataclasses
import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

# GGUF token types (llama.cpp's llama_token_type): CONTROL tokens (e.g. <|im_start|>) must be
# matched whole, before BPE.
_GGUF_CONTROL = 3


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Thin wrapper: plain-int encode/decode plus the special ids the decoder needs."""

    backend: tokenizers.Tokenizer
    bos_id: int | None = None
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        # No BOS is added: SmolLM2's GGUF says add_bos_token=False, HF Llama-3 templates add it
        # in the chat template. Callers that want one prepend `bos_id`.
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def from_tokenizer_json(path: str | os.PathLike, bos_id: int | None = None, eos_id: int | None = None) -> Tokenizer:
    """From a `tokenizer.json` file or a directory holding one."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer(tokenizers.Tokenizer.from_file(path), bos_id, eos_id)


# llama.cpp pre-tokenizer names whose regex splits every digit before the GPT-2 regex runs.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r"}


def from_gguf(reader) -> Tokenizer:
    """Byte-level BPE from a GGUF's `tokenizer.ggml.*` fields (model must be "gpt2")."""
    import gguf

    if not isinstance(reader, gguf.GGUFReader):
        reader = gguf.GGUFReader(os.fspath(reader))
    f = reader.fields
    kind = f["tokenizer.ggml.model"].contents()
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only 'gpt2' (byte-level BPE) is supported")
    tokens = f["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in f["tokenizer.ggml.merges"].contents()]
    types = f["tokenizer.ggml.token_type"].contents()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = f["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in f else "default"
    if pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == _GGUF_CONTROL]
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in control])
    get = lambda k: int(f[k].contents()) if k in f else None  # noqa: E731
    return Tokenizer(tok, get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id"))
