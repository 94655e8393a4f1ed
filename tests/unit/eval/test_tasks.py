import re

import pytest

from neutrain.eval.tasks import TASKS, char_tokenizer, count_tokens, fit_by_binary_search, generate_task


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_lengths_answers_and_seeds(tok, task):
    length = 1500
    samples = generate_task(task, tok, length, num_samples=2, seed=7)
    for s in samples:
        assert s.num_tokens == count_tokens(tok, s.prompt)
        assert s.num_tokens + s.max_new_tokens <= length
        assert s.num_tokens + s.max_new_tokens > length - 150  # filled close to the target
        for ans in s.answers:
            assert ans in s.prompt
    again = generate_task(task, tok, length, num_samples=2, seed=7)
    assert [s.prompt for s in again] == [s.prompt for s in samples]
    assert generate_task(task, tok, length, num_samples=1, seed=8)[0].prompt != samples[0].prompt
    assert samples[0].prompt != samples[1].prompt


def test_answers_are_the_right_ones(tok):
    (s,) = generate_task("niah_multikey", tok, 1500, 1, seed=3)
    query = s.meta["keys"][0]
    assert re.findall(rf"numbers for {query} is: (\d+)", s.prompt) == s.answers
    assert len(re.findall(r"special magic numbers for [a-z]+-[a-z]+ is: \d+", s.prompt)) == 4
    (s,) = generate_task("niah_multivalue", tok, 1500, 1, seed=3)
    assert sorted(re.findall(r"is: (\d+)", s.prompt)) == sorted(s.answers) and len(s.answers) == 4
    (s,) = generate_task("variable_tracking", tok, 1500, 1, seed=3)
    value = re.search(rf"VAR {s.answers[0]} = (\d+)", s.prompt).group(1)
    for prev, cur in zip(s.answers, s.answers[1:]):
        assert f"VAR {cur} = VAR {prev}." in s.prompt
    assert f"value {value}" in s.prompt
    (s,) = generate_task("common_words", tok, 4000, 1, seed=3)
    listing = s.prompt.split("\n")[1]
    counts = {}
    for w in re.findall(r"\d+\. ([a-z]+)", listing):
        counts[w] = counts.get(w, 0) + 1
    assert set(sorted(counts, key=counts.get, reverse=True)[:10]) == set(s.answers)
    (s,) = generate_task("frequent_words", tok, 3000, 1, seed=3)
    words = s.prompt.split("\n")[1].split()
    freq = {w: words.count(w) for w in set(words) if w != "..."}
    assert sorted(freq, key=freq.get, reverse=True)[:3] == s.answers


def test_binary_search_is_maximal(tok):
    build = lambda n: "x" * (3 * n) + "?"  # noqa: E731
    n, text = fit_by_binary_search(build, tok, 100, upper=1000)
    assert n == 33 and count_tokens(tok, text) <= 100 < count_tokens(tok, build(n + 1))
    with pytest.raises(ValueError):
        fit_by_binary_search(lambda n: "y" * (200 + n), tok, 100, upper=10)


def test_char_tokenizer_roundtrip(tok):
    text = "VAR ABCDE = 12345.\nOne of the special magic numbers for calm-otter is: 7654321."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
