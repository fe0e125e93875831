"""Tokenizers: HF `tokenizer.json`, or one rebuilt from GGUF metadata: a GPT-2-style byte-level BPE (SmolLM2),
or Gemma's SentencePiece BPE with byte fallback (Gemma 3), built as transformers builds it from the same file."""

from __future__ import annotations

import dataclasses
import os

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from fathom_jax.models import families

# GGUF token types (llama.cpp's llama_token_type): CONTROL tokens (e.g. <|im_start|>) must be
# matched whole, before BPE; so must USER_DEFINED ones (Gemma's runs of newlines), which are not special.
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Thin wrapper: plain-int encode/decode plus the special ids the decoder needs."""

    backend: tokenizers.Tokenizer
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False  # the model expects `bos_id` before a prompt (Gemma's GGUF says so; encode adds none)

    def encode(self, text: str) -> list[int]:
        # No BOS is added: SmolLM2's GGUF says add_bos_token=False, HF Llama-3 templates add it
        # in the chat template, and spans of text get encoded separately. Callers that want one (see
        # `add_bos`) prepend `bos_id`.
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def encode_prompt(tokenizer, text: str) -> list[int]:
    """``text`` as the start of a sequence: ``tokenizer.encode(text)``, BOS first where the model asks for one
    (``add_bos``: Gemma's GGUF)."""
    ids = tokenizer.encode(text)
    return [tokenizer.bos_id, *ids] if getattr(tokenizer, "add_bos", False) else ids


def hf_tokenizer(path: str | os.PathLike):
    """The `tokenizer.json` of a HF checkpoint directory."""
    file = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} does not exist: the checkpoint directory needs its tokenizer.json")
    try:
        return from_tokenizer_json(file)
    except Exception as err:  # the tokenizers library raises its own exception type
        raise ValueError(f"{file} is not a readable tokenizer ({err})") from err


def from_tokenizer_json(path: str | os.PathLike, bos_id: int | None = None, eos_id: int | None = None) -> Tokenizer:
    """From a `tokenizer.json` file or a directory holding one."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer(tokenizers.Tokenizer.from_file(path), bos_id, eos_id)


# llama.cpp pre-tokenizer names whose regex splits every digit before the GPT-2 regex runs.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r"}


def from_gguf(reader) -> Tokenizer:
    """The tokenizer a GGUF's `tokenizer.ggml.*` fields describe: byte-level BPE ("gpt2"), or a family's
    SentencePiece BPE ("llama"; the family whose ``sentencepiece_architectures`` hold the file's architecture,
    ``families.py``: Gemma's for a gemma/gemma2/gemma3 file)."""
    import gguf

    if not isinstance(reader, gguf.GGUFReader):
        reader = gguf.GGUFReader(os.fspath(reader))
    f = reader.fields
    kind = f["tokenizer.ggml.model"].contents()
    arch = f["general.architecture"].contents() if "general.architecture" in f else None
    family = families.for_sentencepiece(arch)
    if kind == "gpt2":
        tok = _byte_level_bpe(f)
    elif kind == "llama" and family is not None:
        tok = _SENTENCEPIECE[family.sentencepiece](f)
    else:
        archs = sorted(a for fam in families.FAMILIES for a in fam.sentencepiece_architectures)
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (architecture {arch!r}); supported: 'gpt2' "
                         f"(byte-level BPE), and 'llama' (SentencePiece) for {archs}")
    get = lambda k: int(f[k].contents()) if k in f else None  # noqa: E731
    add_bos = bool(f["tokenizer.ggml.add_bos_token"].contents()) if "tokenizer.ggml.add_bos_token" in f else False
    return Tokenizer(tok, get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id"), add_bos)


def _byte_level_bpe(f) -> tokenizers.Tokenizer:
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
    return tok


def _gemma_bpe(f) -> tokenizers.Tokenizer:
    """transformers' GGUF Gemma tokenizer (``integrations/gguf/gguf_tokenizer_mapping.gemma_tokenizer`` and
    ``GemmaTokenizer``), rebuilt step for step: the same vocabulary, merges, normalizer, pre-tokenizer, decoder
    and added tokens, so that both encode every text alike."""
    tokens = list(f["tokenizer.ggml.tokens"].contents())
    types = f["tokenizer.ggml.token_type"].contents()
    # The file spells tokens made of 2+ spaces with real spaces; the normalizer writes spaces as "\u2581".
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    # The file lists no merges: each token's splits into two vocabulary tokens, best-first by the token's
    # position in the file (Gemma's scores do not follow its merge order).
    merges = _merges_by_position(spelled, vocab)
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                                          dropout=None, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == _GGUF_CONTROL])
    known = tok.get_vocab(with_added_tokens=True)
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types, strict=True) if ty == _GGUF_USER_DEFINED and t in known])
    return tok


def _merges_by_position(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """transformers' ``generate_merges(vocab, {token: -position})``: every split of a token into two vocabulary
    tokens, ordered by the token's position in the file (first wins), then by a longer left part."""
    found = []
    for token in dict.fromkeys(tokens):  # a token spelled twice ranks by its last position, as in transformers
        rank = -vocab[token]
        for cut in range(len(token) - 1, 0, -1):  # longer left part first
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                found.append((rank, left, right))
    found.sort(key=lambda m: m[0], reverse=True)  # stable: keeps the longer-left-first order within a token
    return [(left, right) for _, left, right in found]


# A family's ``sentencepiece`` -> the builder of its tokenizer from the GGUF's fields
_SENTENCEPIECE = {"gemma": _gemma_bpe}
