"""RULER-style samples: exact prompt lengths, the gold in the prompt, the templates, determinism, errors."""

import numpy as np
import pytest

from fathom_jax.eval import ruler, texts


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from fathom_jax.models.hub import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def sentences():
    return texts.prose_sentences()[0]


def test_prose_sentences_are_real_prose_past_the_calibration_window():
    sentences, info = texts.prose_sentences()
    assert info["sentences"] == len(sentences) > 500 and info["skip_chars"] == texts.HAYSTACK_SKIP_CHARS
    assert all(s[0].isupper() or not s[0].isalpha() for s in sentences[:50])
    calib, _ = texts.calibration_text()
    assert sentences[0] not in calib[: texts.HAYSTACK_SKIP_CHARS]  # disjoint from the calibration window


@pytest.mark.parametrize("task", ruler.TASKS)
def test_every_task_builds_exact_length_prompts_with_the_gold_inside(tokenizer, sentences, task):
    samples = ruler.make_samples(tokenizer, (task,), per_task=2, prompt_tokens=1024, seed=3, sentences=sentences)
    assert len(samples) == 2 and samples[0].prompt != samples[1].prompt
    for s in samples:
        assert s.task == task and len(s.prompt) == 1024 and s.gen_tokens == ruler.GEN_TOKENS[task]
        text = tokenizer.decode(list(s.prompt))
        for gold in s.gold:
            assert gold in text, (task, gold)
        if task.startswith("niah"):
            assert text.startswith("Some special magic numbers are hidden")
            assert text.endswith("mentioned in the provided text are")
            assert len(s.depths) == {"niah_single": 1, "niah_multikey": 8}.get(task, 4)
            assert all(0.03 <= d <= 0.97 for d in s.depths)  # sentence boundaries near [0.05, 0.95]
        elif task == "vt":
            assert len(s.gold) == ruler.VT_HOPS + 1 and "Find all variables that are assigned the value" in text
        else:
            assert len(s.gold) == 3 and "three most frequently appeared words are:" in text
    again = ruler.make_samples(tokenizer, (task,), per_task=2, prompt_tokens=1024, seed=3, sentences=sentences)
    assert again == samples


def test_multikey_has_decoys_and_the_frequent_words_are_the_most_frequent(tokenizer, sentences):
    s, = ruler.make_samples(tokenizer, ("niah_multikey",), per_task=1, prompt_tokens=1024, sentences=sentences)
    text = tokenizer.decode(list(s.prompt))
    assert text.count("One of the special magic numbers for") == 1 + ruler.MULTIKEY_DECOYS
    f, = ruler.make_samples(tokenizer, ("fwe",), per_task=1, prompt_tokens=1024, sentences=sentences)
    words = tokenizer.decode(list(f.prompt)).split("coded words.")[1].split("\nQuestion:")[0].split()[:-1]
    counts = {w: words.count(w) for w in set(words) if w != "...."}
    top = sorted(counts.values(), reverse=True)
    assert [counts[g] for g in f.gold] == top[:3] and top[2] > top[3]


def test_score_is_the_fraction_of_gold_strings_found():
    assert ruler.score("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert ruler.score("ABC", ["abc"]) == 1.0 and ruler.score("", ["x"]) == 0.0


def test_bad_tasks_and_a_prompt_too_short_for_its_template(tokenizer, sentences):
    with pytest.raises(ValueError, match="unknown RULER task.*niah_single"):
        ruler.check_tasks(["niah_single", "needle"])
    with pytest.raises(ValueError, match="listed twice"):
        ruler.check_tasks(["vt", "vt"])
    with pytest.raises(ValueError, match="tokens of haystack"):
        ruler.make_samples(tokenizer, ("niah_multikey",), per_task=1, prompt_tokens=150, sentences=sentences)


def test_depths_are_spread_over_the_window(tokenizer, sentences):
    samples = ruler.make_samples(tokenizer, ("niah_single",), per_task=12, prompt_tokens=600, sentences=sentences)
    depths = np.array([s.depths[0] for s in samples])
    assert depths.min() < 0.35 and depths.max() > 0.65


def test_a_haystack_longer_than_the_text_goes_round_it_again(tokenizer, sentences):
    """As RULER repeats its essays: a prompt longer than one pass over the sentences reuses them in order, the
    needle still inside, and the report says so."""
    from fathom_jax.eval import downstream_report

    few = sentences[:12]
    one_pass = ruler.haystack_tokens(tokenizer, few)
    [sample] = ruler.make_samples(tokenizer, ("niah_single",), per_task=1, prompt_tokens=3 * one_pass, sentences=few)
    assert len(sample.prompt) == 3 * one_pass
    text = tokenizer.decode(list(sample.prompt))
    assert text.count(few[5]) >= 2 and sample.gold[0] in text
    assert "2.50 passes" in downstream_report._repeats({"tokens": 100}, 250)
    assert downstream_report._repeats({"tokens": 100}, 100) == downstream_report._repeats({}, 250) == ""
