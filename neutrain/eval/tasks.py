"""Offline, seeded long-context tasks in the style of RULER (arXiv 2404.06654).

Every task is generated from a seed with the standard library only: the noise
haystack ("The grass is green. ...") replaces RULER's essays (not on PyPI), and
keys come from small built-in word lists instead of ``wonderwords``. A sample's
length is measured in tokens of the model's own tokenizer: the amount of filler
is found by binary search so that prompt + answer budget fits ``length`` tokens.

Tasks (RULER names in brackets):

* ``niah_single`` (niah_single_1): one needle "special magic number for KEY".
* ``niah_multikey`` (niah_multikey_2): four needles with different keys; one is asked.
* ``niah_multivalue`` (niah_multivalue): four needles share a key; all values are asked.
* ``variable_tracking`` (vt): a 4-hop chain VAR A = 12345, VAR B = VAR A, ...
* ``common_words`` (cwe): the 10 words repeated most often in a numbered list.
* ``frequent_words`` (fwe): the 3 most frequent coded words (after the noise word "...").

Example:
    >>> from neutrain.eval.tasks import char_tokenizer, generate_task
    >>> tok = char_tokenizer()
    >>> samples = generate_task("niah_single", tok, length=512, num_samples=2, seed=0)
    >>> len(tok(samples[0].prompt, add_special_tokens=False)["input_ids"]) <= 512
    True
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field
from typing import Callable

from neutrain.config.names import LONG_CONTEXT_TASKS

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_ADJECTIVES = (
    "able bold brave calm clean clever cosy crisp curly damp dark deep dizzy eager early fancy fast fierce "
    "fluffy fresh gentle giant glad grand green happy heavy hollow honest huge icy jolly kind lazy light "
    "lively loud lucky mighty misty modern narrow neat noble odd plain polite proud quick quiet rapid rare "
    "rich rough round royal rusty shiny silent silly sleepy smooth soft solid sour spicy steep sticky sunny "
    "sweet swift tall tame tiny tough vast warm wild windy wise witty young zesty"
).split()
_NOUNS = (
    "anchor apple arrow badge barrel basket beacon bell blanket bottle bridge bucket button cabin candle "
    "canyon carpet castle cedar chair cherry circle cloud comet copper cotton crater crown desert dragon "
    "drum eagle engine falcon feather fiddle forest fountain garden glacier guitar hammer harbor helmet "
    "island jacket kettle ladder lantern lemon magnet marble meadow mirror needle ocean orchard otter "
    "paddle pebble pepper piano pillow planet pocket puzzle rabbit ribbon river rocket saddle shovel "
    "spider spoon statue tiger tower tulip tunnel violin wagon walnut whistle window wizard"
).split()
_VERBS = (
    "bake bend blink bloom boil bounce build carry chase climb crawl dance dig dive drift dream float fold "
    "gather glow greet hike hum jump juggle kneel knit laugh leap mend melt nod paint pour push race read "
    "ring roam row run sail scrub sew shine sing skate skip sleep slide smile sneeze sort spin splash stir "
    "swim swing talk throw tickle travel tumble wander wave whisper wink write yawn"
).split()


@dataclass
class Sample:
    """One generated prompt.

    Attributes:
        task: Task name.
        prompt: Full input text, ending with the answer prefix.
        answers: Strings that must all appear in the generation.
        max_new_tokens: Token budget for the answer.
        num_tokens: Prompt length in tokens of the tokenizer it was sized for.
        meta: Generator details (needle depth, keys, ...), for debugging.
    """

    task: str
    prompt: str
    answers: list[str]
    max_new_tokens: int
    num_tokens: int = 0
    meta: dict = field(default_factory=dict)


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` built offline (printable ASCII + newline).

    Models trained from scratch in tests and benchmarks use it: no download, and a
    digit is one token, which makes retrieval learnable by a small model.

    Example:
        >>> tok = char_tokenizer()
        >>> tok.decode(tok("VAR X = 1", add_special_tokens=False)["input_ids"])
        'VAR X = 1'
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = ["<pad>", "<bos>", "<eos>", "<unk>", "\n"] + [chr(i) for i in range(32, 127)]
    core = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def count_tokens(tokenizer, text: str) -> int:
    """Number of tokens ``tokenizer`` turns ``text`` into, special tokens excluded."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def fit_by_binary_search(build: Callable[[int], str], tokenizer, max_tokens: int, upper: int) -> tuple[int, str]:
    """Largest ``n`` in [0, upper] with ``count_tokens(build(n)) <= max_tokens``, and its text.

    ``build`` must grow monotonically in ``n`` (more filler, more tokens). RULER
    sizes haystacks the same way, with the target model's tokenizer.
    """
    lo, hi = 0, upper
    if count_tokens(tokenizer, build(0)) > max_tokens:
        raise ValueError(f"even an empty haystack exceeds {max_tokens} tokens; raise the length")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, build(mid)) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return lo, build(lo)


_NOISE_SENTENCES = [x.strip() + "." for x in NOISE.split(".") if x.strip()]


def _noise(n: int) -> list[str]:
    """The first ``n`` sentences of the repeated noise haystack (sentence granularity keeps lengths tight)."""
    return [_NOISE_SENTENCES[i % len(_NOISE_SENTENCES)] for i in range(n)]


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _insert(filler: list[str], items: list[str], rng: random.Random) -> list[str]:
    """Insert ``items`` into ``filler`` at seeded depths, keeping their relative order."""
    depths = sorted(rng.randint(0, len(filler)) for _ in items)
    out = list(filler)
    for offset, (depth, item) in enumerate(zip(depths, items)):
        out.insert(depth + offset, item)
    return out


def _niah_builder(rng: random.Random, num_keys: int, num_values: int):
    """Draw keys/values and return ``(build(n) -> prompt with n noise sentences, answers, keys)``."""
    keys: list[str] = []
    while len(keys) < num_keys:
        k = _key(rng)
        if k not in keys:
            keys.append(k)
    values = {k: [_number(rng) for _ in range(num_values if i == 0 else 1)] for i, k in enumerate(keys)}
    needles = [f"One of the special magic numbers for {k} is: {v}." for k in keys for v in values[k]]
    rng.shuffle(needles)
    query = keys[0]
    question = (
        f"\nWhat are all the special magic numbers for {query} mentioned in the provided text?"
        f" The special magic numbers for {query} mentioned in the provided text are:"
    )
    state = rng.getstate()

    def build(n: int) -> str:
        rng.setstate(state)  # same depths for every candidate n: length is the only variable
        body = _insert(_noise(n), needles, rng)
        return "Some special magic numbers are hidden within the following text. Make sure to memorize them.\n" + " ".join(body) + question

    return build, values[query], keys


def _niah(tokenizer, length: int, rng: random.Random, num_keys: int, num_values: int, task: str) -> Sample:
    build, answers, keys = _niah_builder(rng, num_keys, num_values)
    max_new = 12 * num_values
    n, prompt = fit_by_binary_search(build, tokenizer, length - max_new, upper=max(1, length // 2))
    return Sample(task, prompt, answers, max_new, meta={"haystack_sentences": n, "keys": keys})


def niah_training_sample(rng: random.Random, sentences: int, num_keys: int = 1, num_values: int = 1) -> Sample:
    """A NIAH sample with a fixed number of noise sentences (no tokenizer, no search): fast, for training.

    Same format as the ``niah_*`` tasks, so a model trained on these is evaluated in-distribution.
    """
    build, answers, keys = _niah_builder(rng, num_keys, num_values)
    return Sample(f"niah_k{num_keys}_v{num_values}", build(sentences), answers, 12 * num_values, meta={"keys": keys})


def _variable_tracking(tokenizer, length: int, rng: random.Random, hops: int = 4) -> Sample:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    question = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
        f" Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables"
        f" are assigned the value {value}, they are:"
    )
    state = rng.getstate()
    max_new = 8 * (hops + 1)

    def build(n: int) -> str:
        rng.setstate(state)
        body = _insert(_noise(n), chain, rng)
        return "Memorize and track the chain(s) of variable assignment hidden in the following text.\n" + " ".join(body) + question

    n, prompt = fit_by_binary_search(build, tokenizer, length - max_new, upper=max(1, length // 2))
    return Sample("variable_tracking", prompt, names, max_new, meta={"haystack_sentences": n})


def _common_words(tokenizer, length: int, rng: random.Random, num_common: int = 10, freq_common: int = 30, freq_rare: int = 3) -> Sample:
    vocab = sorted(set(_ADJECTIVES + _NOUNS + _VERBS))
    rng.shuffle(vocab)
    common, rare_pool = vocab[:num_common], vocab[num_common:]
    question = f"\nQuestion: What are the {num_common} most common words in the above list? Answer: The top {num_common} words that appear most often in the list are:"
    rare_seed = rng.random()
    state = rng.getstate()
    max_new = 12 * num_common

    def build(n_rare: int, freq_common: int = freq_common) -> str:
        rng.setstate(state)
        # Past the built-in words, rare words are seeded 7-letter strings (RULER draws more from a big list).
        while len(rare_pool) < n_rare:
            extra = random.Random(f"{rare_seed}:{len(rare_pool)}")
            rare_pool.append("".join(extra.choice(string.ascii_lowercase) for _ in range(7)))
        words = common * freq_common + [w for w in rare_pool[:n_rare] for _ in range(freq_rare)]
        rng.shuffle(words)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n" + listing + question

    # Short contexts cannot hold 10 x 30 copies: lower the common frequency (kept above the rare one) until it fits.
    freq = next(
        (f for f in range(freq_common, freq_rare, -1) if count_tokens(tokenizer, build(0, f)) <= length - max_new),
        freq_common,
    )
    n, prompt = fit_by_binary_search(lambda k: build(k, freq), tokenizer, length - max_new, upper=max(1, length // 4))
    return Sample("common_words", prompt, common, max_new, meta={"rare_words": n, "freq_common": freq})


def _frequent_words(tokenizer, length: int, rng: random.Random, alpha: float = 2.0, top: int = 3) -> Sample:
    vocab_size = max(8, length // 50)
    coded = []
    while len(coded) < vocab_size:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
        if w not in coded:
            coded.append(w)
    coded[0] = "..."  # RULER: the most frequent word is noise; the answer is the next ``top``
    weights = [1.0 / (rank + 1) ** alpha for rank in range(vocab_size)]
    question = f"\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the {top} most frequently appeared words in the above coded text? Answer: According to the coded text above, the {top} most frequently appeared words are:"
    state = rng.getstate()
    max_new = 8 * top

    def counts_for(n: int) -> list[int]:
        # Deterministic Zipf counts (not sampled) so that ranks 1..top are strictly ordered at any n.
        return [max(1, round(n * w / sum(weights))) if r <= top + 1 else int(n * w / sum(weights)) for r, w in enumerate(weights)]

    def build(n: int) -> str:
        rng.setstate(state)
        words = [w for w, c in zip(coded, counts_for(n)) for _ in range(c)]
        rng.shuffle(words)
        return "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words.\n" + " ".join(words) + question

    n, prompt = fit_by_binary_search(build, tokenizer, length - max_new, upper=4 * length)
    counts = counts_for(n)
    if len(set(counts[1 : top + 2])) < top + 1:
        raise ValueError(f"length {length} too short for distinct frequent-word counts")
    return Sample("frequent_words", prompt, coded[1 : top + 1], max_new, meta={"words": n})


TASKS: dict[str, Callable[..., Sample]] = {
    "niah_single": lambda tok, n, rng: _niah(tok, n, rng, 1, 1, "niah_single"),
    "niah_multikey": lambda tok, n, rng: _niah(tok, n, rng, 4, 1, "niah_multikey"),
    "niah_multivalue": lambda tok, n, rng: _niah(tok, n, rng, 1, 4, "niah_multivalue"),
    "variable_tracking": _variable_tracking,
    "common_words": _common_words,
    "frequent_words": _frequent_words,
}
for _name in TASKS:  # every command's recipe is checked against these names at load (neutrain.config.validate)
    LONG_CONTEXT_TASKS.add(_name)
del _name


def generate_task(name: str, tokenizer, length: int, num_samples: int, seed: int = 42) -> list[Sample]:
    """Generate ``num_samples`` prompts of task ``name``, each at most ``length`` tokens incl. the answer budget.

    Args:
        name: A key of :data:`TASKS`.
        tokenizer: The model's tokenizer (lengths are counted in its tokens).
        length: Target total length (prompt + ``max_new_tokens``) in tokens.
        num_samples: How many samples.
        seed: RULER's default is 42; sample ``i`` uses ``seed + i`` so any subset reproduces.
    """
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    samples = []
    for i in range(num_samples):
        sample = TASKS[name](tokenizer, length, random.Random(f"{name}:{seed + i}"))
        sample.num_tokens = count_tokens(tokenizer, sample.prompt)
        samples.append(sample)
    return samples
