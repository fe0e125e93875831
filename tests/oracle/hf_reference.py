"""Reference outputs from Hugging Face `transformers` (PyTorch, CPU, float32).

Runs in the oracle venv `.venv-ref` (Python 3.11: the only local CPU torch wheel), never inside
the JAX test process. The pytest suite calls it as a subprocess and compares against the .npz
files it writes.

  python hf_reference.py tiny --out DIR
      For each case (llama, llama3, qwen2, qwen3, gemma3): write a tiny random checkpoint with
      `save_pretrained` to DIR/<case>/ and DIR/<case>/ref.npz with
      tokens [T], logits [T, V] and, from the 8-token prompt tokens[:8], greedy [32].
      The "gemma3" case is a Gemma3ForCausalLM: sliding window 4, one global layer in two, a local layer
      after the last global one, linear RoPE scaling on the global layers, final logit softcapping.
  python hf_reference.py gguf --gguf FILE --prompt TEXT [--extra-prompt TEXT ...] --new-tokens N [--bos] --out NPZ
      Load FILE with transformers' own GGUF loader, dump tokens, logits and N greedy tokens (and for each
      extra prompt its tokens, its last position's logits and N greedy tokens, as extra_tokens_<i> /
      extra_last_logits_<i> / extra_greedy_<i>). --bos: tokenize prompts with the tokenizer's special tokens
      (BOS). --tokenize TEXT (repeatable): also dump TEXT's tokens without special tokens, as tokenize_<i>.
      The model's config (JSON) is saved as config.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import transformers

TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=128,
    initializer_range=0.1,  # wide logit gaps: greedy parity must not hinge on near-ties
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

CASES = {
    # case: (config class, extra kwargs, rope_theta, rope scaling or None, save kwargs)
    "llama": ("LlamaConfig", dict(attention_bias=True, tie_word_embeddings=False), 10000.0, None, {}),
    "llama3": (
        "LlamaConfig",
        dict(tie_word_embeddings=True),
        500000.0,
        dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
             original_max_position_embeddings=64),
        {},
    ),
    # Sharded on purpose: exercises model.safetensors.index.json.
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False), 1000000.0, None, dict(max_shard_size="40KB")),
    # head_dim != hidden / heads, as in real Qwen3 configs.
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True), 1000000.0, None, {}),
    # rope_parameters per layer type (transformers >= 5); query_pre_attn_scalar != head_dim.
    "gemma3": (
        "Gemma3TextConfig",
        dict(num_hidden_layers=5, head_dim=16, sliding_window=4, query_pre_attn_scalar=12, final_logit_softcapping=10.0,
             layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"], tie_word_embeddings=True,
             rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000000.0),
                              "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
        None, None, {},
    ),
}

PROMPT_LEN, GEN_LEN, SEQ_LEN = 8, 32, 24


def _config(case: str):
    cls_name, extra, theta, scaling, _ = CASES[case]
    kw = dict(TINY, **extra)
    if "rope_parameters" in kw:  # given whole (Gemma 3: per layer type)
        return getattr(transformers, cls_name)(**kw)
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = dict(rope_type="default", rope_theta=theta) if scaling is None else dict(
            scaling, rope_theta=theta
        )
    else:
        kw["rope_theta"] = theta
        kw["rope_scaling"] = scaling
    return getattr(transformers, cls_name)(**kw)


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, n: int, *, with_logits: bool = False):
    """Greedy decode through HF's own KV cache (no `generate`: no EOS or min-length logit edits); with_logits:
    also the prompt's last position's logits [V]."""
    out = model(prompt, use_cache=True, logits_to_keep=1)
    first = out.logits[0, -1].float().numpy()
    past, nxt, toks = out.past_key_values, out.logits[:, -1].argmax(-1), []
    for _ in range(n):
        toks.append(int(nxt))
        out = model(nxt[:, None], past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
    return (np.array(toks, np.int64), first) if with_logits else np.array(toks, np.int64)


@torch.no_grad()
def tiny(out_dir: str) -> None:
    for i, case in enumerate(CASES):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(_config(case), dtype=torch.float32).eval()
        # Norm weights init to 1 and biases to 0 would hide swapped or dropped tensors: randomise.
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
        path = os.path.join(out_dir, case)
        model.save_pretrained(path, **CASES[case][4])
        tokens = torch.from_numpy(np.random.default_rng(i).integers(0, TINY["vocab_size"], SEQ_LEN))
        logits = model(tokens[None]).logits[0].float().numpy()
        gen = greedy(model, tokens[None, :PROMPT_LEN], GEN_LEN)
        np.savez(os.path.join(path, "ref.npz"), tokens=tokens.numpy(), logits=logits, greedy=gen)


@torch.no_grad()
def gguf(path: str, prompt: str, new_tokens: int, out: str, extra: list[str], bos: bool = False,
         texts: tuple[str, ...] = ()) -> None:
    d, f = os.path.split(os.path.abspath(path))
    # The config once, handed on: each load would otherwise parse the GGUF's metadata again (seconds each).
    config = transformers.AutoConfig.from_pretrained(d, gguf_file=f)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, config=config, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f, config=config)
    encode = lambda text: tok(text, return_tensors="pt", add_special_tokens=bos).input_ids  # noqa: E731
    ids = encode(prompt)
    logits = model(ids).logits[0].float().numpy()
    more = {}
    for i, text in enumerate(extra):  # further prompts: tokens, the last position's logits and greedy
        more[f"extra_tokens_{i}"] = encode(text)[0].numpy()
        more[f"extra_greedy_{i}"], more[f"extra_last_logits_{i}"] = greedy(model, encode(text), new_tokens,
                                                                           with_logits=True)
    for i, text in enumerate(texts):
        more[f"tokenize_{i}"] = np.asarray(tok(text, add_special_tokens=False).input_ids, np.int64)
    more["config"] = np.array(model.config.to_json_string())  # the config transformers built from the metadata
    np.savez(out, tokens=ids[0].numpy(), logits=logits, greedy=greedy(model, ids, new_tokens), **more)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tiny")
    t.add_argument("--out", required=True)
    g = sub.add_parser("gguf")
    g.add_argument("--gguf", required=True)
    g.add_argument("--prompt", required=True)
    g.add_argument("--extra-prompt", action="append", default=[], help="a further prompt (tokens, last logits, greedy)")
    g.add_argument("--new-tokens", type=int, default=16)
    g.add_argument("--bos", action="store_true", help="add the tokenizer's special tokens (Gemma: BOS)")
    g.add_argument("--tokenize", action="append", default=[], help="a further text (its tokens only)")
    g.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(2)
    if a.cmd == "tiny":
        tiny(a.out)
    else:
        gguf(a.gguf, a.prompt, a.new_tokens, a.out, a.extra_prompt, a.bos, tuple(a.tokenize))


if __name__ == "__main__":
    main()
