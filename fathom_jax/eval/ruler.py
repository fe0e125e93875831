"""RULER-style tasks (paper 5.5, Table 7, Appendix B) on a haystack of real prose.

Six tasks with RULER's templates (NVIDIA/RULER ``scripts/data/synthetic/constants.py``) and the paper's
settings: single needle, multi-key (one target key and seven decoys), multi-value (four values of one
key), multi-query (four keys, one value each), variable tracking (a chain of four hops through one decoy
chain) and frequent-word extraction (the three most frequent coded words drawn with Zipf exponent 2).
Needles sit at random depths in [0.05, 0.95] of a window of the prose of Python's documentation
(``texts.prose_sentences``); frequent-word extraction is RULER's coded text, which has no haystack. Every
prompt has exactly ``prompt_tokens`` tokens (so a batch prefills without padding) and is a plain
completion: RULER's template with its answer prefix, no chat template (as the paper). A sample's score is
the fraction of its gold strings contained in the greedy generation of ``GEN_TOKENS[task]`` tokens.

    samples = make_samples(tokenizer, ("niah_single", "vt"), per_task=4, prompt_tokens=4032, seed=0)
    score(tokenizer.decode(tokens[:samples[0].gen_tokens]), samples[0].gold)
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Sequence

import numpy as np

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "fwe")
# Generation lengths of Appendix B: 12 tokens for single numbers, 40 for lists, 24 for words.
GEN_TOKENS = {"niah_single": 12, "niah_multikey": 12, "niah_multivalue": 40, "niah_multiquery": 40, "vt": 40,
              "fwe": 24}
DEPTHS = (0.05, 0.95)
MULTIKEY_DECOYS = 7  # the paper's (RULER's multikey-1 default is three)
MULTI = 4  # values of one key (multi-value), keys asked at once (multi-query)
VT_HOPS = 4
FWE_ALPHA = 2.0
FWE_WORD_LEN = 6

# RULER's templates and answer prefixes, verbatim (constants.py). Variable tracking's answer prefix keeps
# RULER's spelling "assgined" as in its generation script's default template.
NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_v} for {query} mentioned in the provided text?")
NIAH_ANSWER = " The special magic {type_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assgined the value {query}, they are: ")
VT_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"

# Keys are adjective-noun pairs, as RULER's "words" needles.
_ADJECTIVES = ("abiding", "agreeable", "ancient", "bashful", "bright", "calm", "careful", "cheerful", "clever",
               "curious", "dapper", "eager", "elegant", "faithful", "fancy", "fierce", "gentle", "gifted", "glossy",
               "grumpy", "handsome", "helpful", "humble", "jolly", "kind", "lively", "lucky", "mellow", "modern",
               "nimble", "obedient", "odd", "polite", "proud", "quaint", "quiet", "rapid", "rustic", "shiny",
               "silly", "sincere", "smooth", "sturdy", "tender", "thankful", "tidy", "vivid", "wary", "witty",
               "zealous")
_NOUNS = ("apartment", "badge", "bathtub", "blanket", "bonnet", "cactus", "camera", "canoe", "carpet", "castle",
          "cellar", "cobweb", "compass", "cottage", "crayon", "dolphin", "drawer", "ferry", "garden", "glacier",
          "harbor", "helmet", "island", "jacket", "kettle", "ladder", "lantern", "meadow", "mirror", "notebook",
          "orchard", "paddle", "parrot", "pebble", "pillow", "pocket", "quilt", "saddle", "scarf", "shovel",
          "spindle", "teapot", "thimble", "trolley", "tunnel", "violin", "wagon", "walnut", "whistle", "zipper")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt (token ids, exactly the prompt length), its gold strings and how many tokens to generate."""

    task: str
    prompt: tuple[int, ...]
    gold: tuple[str, ...]
    gen_tokens: int
    depths: tuple[float, ...] = ()


def score(generation: str, gold: Sequence[str]) -> float:
    """Fraction of the gold strings contained in the generation (case-insensitive; RULER's string_match_all)."""
    text = generation.lower()
    return float(np.mean([g.lower() in text for g in gold]))


def check_tasks(tasks: Sequence[str]) -> tuple[str, ...]:
    tasks = tuple(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown RULER task(s) {unknown or tasks}; choose from {', '.join(TASKS)}")
    if len(set(tasks)) != len(tasks):
        raise ValueError(f"tasks are listed twice: {list(tasks)}")
    return tasks


class _Builder:
    """Builds prompts of an exact token count from template pieces, a haystack and inserted statements."""

    def __init__(self, tokenizer, sentences: Sequence[str], prompt_tokens: int):
        self.tok = tokenizer
        self.n = prompt_tokens
        # Each haystack sentence as its own token list, with the space that joins it to the previous one.
        self.hay = [tokenizer.encode(" " + s) for s in sentences]
        self.hay_tokens = sum(len(h) for h in self.hay)

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def haystack(self, rng, budget: int, inserts: Sequence[tuple[float, list[int]]]) -> tuple[list[int], list[float]]:
        """``budget`` tokens of consecutive haystack sentences from a random start, with each insert (token
        ids) placed between sentences at its depth; returns the tokens and the depths actually used. A haystack
        longer than the text goes round it again, as RULER repeats its essays to fill long contexts."""
        need = budget - sum(len(ids) for _, ids in inserts)
        if need <= 0:
            raise ValueError(f"the prompt leaves {need} tokens of haystack: too short for the task's template")
        start = int(rng.integers(len(self.hay)))
        chunks, total, i = [], 0, start
        while total < need:
            chunks.append(self.hay[i % len(self.hay)])
            total += len(chunks[-1])
            i += 1
        chunks[-1] = chunks[-1][: len(chunks[-1]) - (total - need)]  # cut the last sentence to fit exactly
        bounds = np.cumsum([0] + [len(c) for c in chunks])
        placed = sorted(((int(np.searchsorted(bounds, d * need)), d, ids) for d, ids in inserts), key=lambda x: x[:2])
        out, used, prev = [], [], 0
        for at, d, ids in placed:
            at = min(at, len(chunks))
            for c in chunks[prev:at]:
                out += c
            used.append(float(bounds[at] / max(need, 1)))
            out += ids
            prev = at
        for c in chunks[prev:]:
            out += c
        return out, used

    def assemble(self, head: str, tail: str, context_fn) -> tuple[list[int], list[float]]:
        head_ids, tail_ids = self.enc(head), self.enc(tail)
        budget = self.n - len(head_ids) - len(tail_ids)
        context, depths = context_fn(budget)
        ids = head_ids + context + tail_ids
        assert len(ids) == self.n, (len(ids), self.n)
        return ids, depths


def _key(rng, taken: set) -> str:
    while True:
        key = f"{_ADJECTIVES[rng.integers(len(_ADJECTIVES))]}-{_NOUNS[rng.integers(len(_NOUNS))]}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng, taken: set, digits: int = 7) -> str:
    while True:
        value = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
        if value not in taken:
            taken.add(value)
            return value


def _split_template(template: str, **fields) -> tuple[str, str]:
    head, tail = template.split("{context}")
    return head.format(**fields), tail.format(**fields)


def _niah(b: _Builder, rng, task: str) -> Sample:
    keys, values = set(), set()
    type_v = "numbers"
    if task == "niah_single":
        pairs = [(_key(rng, keys), _number(rng, values))]
        asked = [pairs[0][0]]
        gold = [pairs[0][1]]
    elif task == "niah_multikey":
        pairs = [(_key(rng, keys), _number(rng, values)) for _ in range(1 + MULTIKEY_DECOYS)]
        asked, gold = [pairs[0][0]], [pairs[0][1]]
    elif task == "niah_multivalue":
        key = _key(rng, keys)
        pairs = [(key, _number(rng, values)) for _ in range(MULTI)]
        asked, gold = [key], [v for _, v in pairs]
    else:  # niah_multiquery
        pairs = [(_key(rng, keys), _number(rng, values)) for _ in range(MULTI)]
        asked, gold = [k for k, _ in pairs], [v for _, v in pairs]
    query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    head, tail = _split_template(NIAH_TEMPLATE, type_v=type_v, query=query)
    tail += NIAH_ANSWER.format(type_v=type_v, query=query)
    needles = [(float(rng.uniform(*DEPTHS)), b.enc(" " + NIAH_NEEDLE.format(type_v=type_v, key=k, value=v)))
               for k, v in pairs]
    ids, depths = b.assemble(head, tail, lambda budget: b.haystack(rng, budget, needles))
    return Sample(task, tuple(ids), tuple(gold), GEN_TOKENS[task], tuple(depths))


def _vt_chains(rng, n_chains: int, hops: int, letters: int):
    names = set()
    while len(names) < n_chains * (hops + 1):
        names.add("".join(string.ascii_uppercase[i] for i in rng.integers(26, size=letters)))
    names = sorted(names)
    rng.shuffle(names)
    chains, values = [], set()
    for c in range(n_chains):
        var = names[c * (hops + 1): (c + 1) * (hops + 1)]
        value = _number(rng, values, digits=5)
        chain = [f"VAR {var[0]} = {value}"] + [f"VAR {var[j + 1]} = VAR {var[j]}" for j in range(hops)]
        chains.append((var, value, chain))
    return chains


def _vt_example(rng) -> str:
    """RULER's in-context example: a short chain in its noise sentences, with its answer."""
    (var, value, chain), = _vt_chains(rng, 1, VT_HOPS, 3)
    noise = (VT_NOISE + " ") * 2
    sentences = [s.strip() + "." for s in noise.split(".") if s.strip()]
    slots = sorted(rng.choice(len(sentences) + 1, size=len(chain), replace=False))
    for j, (at, stmt) in enumerate(zip(slots, chain)):
        sentences.insert(at + j, stmt + ".")
    context = " ".join(sentences)
    head, tail = _split_template(VT_TEMPLATE, query=value)
    return head + context + tail + VT_ANSWER.format(num_v=VT_HOPS + 1, query=value) + " ".join(var) + "\n\n"


def _vt(b: _Builder, rng) -> Sample:
    example = _vt_example(rng)
    (var, value, chain), (_, _, decoy) = _vt_chains(rng, 2, VT_HOPS, 5)
    inserts = []
    for stmts in (chain, decoy):  # each chain in order, at sorted random depths
        depths = np.sort(rng.uniform(*DEPTHS, size=len(stmts)))
        inserts += [(float(d), b.enc(" " + s + ".")) for d, s in zip(depths, stmts)]
    head, tail = _split_template(VT_TEMPLATE, query=value)
    tail += VT_ANSWER.format(num_v=VT_HOPS + 1, query=value)
    ids, depths = b.assemble(example + head, tail, lambda budget: b.haystack(rng, budget, inserts))
    return Sample("vt", tuple(ids), tuple(var), GEN_TOKENS["vt"], tuple(depths))


def _fwe(b: _Builder, rng) -> Sample:
    """RULER's frequent-word extraction: the whole context is coded words with Zipf(2) counts, the most
    frequent "word" being the dots to ignore; gold = the next three words by count in the prompt."""
    vocab_size = max(8, b.n // 50)
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(string.ascii_lowercase[i] for i in rng.integers(26, size=FWE_WORD_LEN)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "...."
    zeta = sum(k ** -FWE_ALPHA for k in range(1, 100_000))
    head, tail = _split_template(FWE_TEMPLATE)
    head = head.rstrip(" ")  # the words carry their own leading space (one token each with it)
    tail += FWE_ANSWER

    def context(budget):
        # Enough words to overfill the budget (coded words are ~3 tokens), then cut to it exactly.
        n_words = budget
        counts = (n_words * np.arange(1, vocab_size + 1) ** -FWE_ALPHA / zeta).astype(int)
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        rng.shuffle(words)
        ids = b.enc(" " + " ".join(words))
        if len(ids) < budget:
            raise ValueError("frequent-word extraction: the coded text is shorter than its budget")
        return ids[:budget], []

    ids, _ = b.assemble(head, tail, context)
    text = b.tok.decode(ids)
    body = text[text.index("coded words.") + len("coded words."): text.rindex("\nQuestion:")]
    counts = {}
    for w in body.split()[:-1]:  # the last word may be cut
        counts[w] = counts.get(w, 0) + 1
    ranked = sorted((w for w in counts if w != "...."), key=lambda w: (-counts[w], w))
    if counts[ranked[2]] == counts.get(ranked[3], -1):
        raise ValueError("frequent-word extraction: a tie for the third word")  # never at these sizes
    return Sample("fwe", tuple(ids), tuple(ranked[:3]), GEN_TOKENS["fwe"])


def make_samples(tokenizer, tasks: Sequence[str], per_task: int, prompt_tokens: int, seed: int = 0,
                 sentences: Sequence[str] | None = None) -> list[Sample]:
    """``per_task`` samples of every task, each prompt exactly ``prompt_tokens`` tokens (deterministic in
    ``seed``), in task-major order."""
    tasks = check_tasks(tasks)
    if sentences is None:
        from fathom_jax.eval import texts

        sentences, _ = texts.prose_sentences()
    builder = _Builder(tokenizer, sentences, prompt_tokens)
    out = []
    for t, task in enumerate(tasks):
        rng = np.random.default_rng([seed, t])
        for _ in range(per_task):
            if task.startswith("niah"):
                out.append(_niah(builder, rng, task))
            elif task == "vt":
                out.append(_vt(builder, rng))
            else:
                out.append(_fwe(builder, rng))
    return out


def haystack_tokens(tokenizer, sentences: Sequence[str]) -> int:
    """Tokens of one pass over the haystack text (a longer haystack repeats it)."""
    return _Builder(tokenizer, sentences, 0).hay_tokens


def max_gen_tokens(tasks: Sequence[str]) -> int:
    return max(GEN_TOKENS[t] for t in tasks)
