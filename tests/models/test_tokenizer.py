import pytest

from fathom_jax.models.tokenizer import _merges_by_position, from_gguf, from_tokenizer_json

TEXT = "def f(x):\n    return x ** 2  # 12345 squares\n<|im_start|>user\nHéllo wörld!<|im_end|>"


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return from_gguf(smollm2_path)


def test_gguf_tokenizer_roundtrip_and_specials(tok):
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)
    # Control tokens are atomic, and digits are split one per token (llama.cpp's "smollm" pre-tokenizer).
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert len(tok.encode("12345")) == 5


def test_tokenizer_json_roundtrip(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    again = from_tokenizer_json(tmp_path, bos_id=1, eos_id=2)
    assert again.encode(TEXT) == tok.encode(TEXT)


def test_gemma_merges_follow_file_order_then_longer_left_part():
    """transformers' generate_merges(vocab, {token: -position}) for Gemma files, which list no merges."""
    tokens = ["a", "b", "c", "ab", "abc", "bc", "ca"]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert _merges_by_position(tokens, vocab) == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c"), ("c", "a")]
