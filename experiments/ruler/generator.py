"""RULER-style samples at any token length, generated offline and seeded.

Each task renders its prompt from ``n`` haystack units (noise sentences, list words or
coded words); a binary search on ``n`` finds the longest prompt whose token count, as the
engine will see it (chat template and answer prefix included), does not exceed the
target. Units are a few tokens each, so a prompt lands within a few tokens of its target.
Templates follow RULER (Hsieh et al., 2024, arXiv:2404.06654); the haystack is its
"noise" haystack so nothing is downloaded.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from experiments.ruler import words as W

NOISE_PARTS = [s.strip() + "." for s in W.NOISE_SENTENCE.split(".") if s.strip()]

# RULER's generation lengths, trimmed to what the answers need.
MAX_NEW_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "vt": 32, "cwe": 64,
                  "fwe": 24, "passkey": 12}
RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe", "fwe")

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
              "I will quiz you about the numbers afterwards.")


@dataclass(frozen=True)
class RulerSample:
    task: str
    index: int
    seed: int
    target_length: int
    prompt_ids: list[int]
    text: str  # the user message: instructions, context and question
    answer_prefix: str  # appended after the (chat) prompt, as RULER does
    answers: list[str]
    max_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass
class _Render:
    text: str
    answer_prefix: str
    answers: list[str]


Renderer = Callable[[int], _Render]


def _noise(n: int) -> list[str]:
    return [NOISE_PARTS[i % len(NOISE_PARTS)] for i in range(n)]


def _insert(units: list[str], needles: list[str], depths: list[float]) -> str:
    out = list(units)
    for needle, depth in sorted(zip(needles, depths), key=lambda x: -x[1]):
        out.insert(round(depth * len(units)), needle)
    return " ".join(out)


def _niah(rng: random.Random, num_keys: int, num_values: int) -> Renderer:
    keys = W.unique_words(rng, num_keys)
    values = [[W.magic_number(rng) for _ in range(num_values)] for _ in keys]
    needles, depths = [], []
    for key, vals in zip(keys, values):
        for v in vals:
            needles.append(f"One of the special magic numbers for {key} is: {v}.")
            depths.append(rng.random())
    order = list(range(len(needles)))
    rng.shuffle(order)
    needles, depths = [needles[i] for i in order], [depths[i] for i in order]
    query = keys[0]
    if num_values > 1:
        question = f"What are all the special magic numbers for {query} mentioned in the provided text?"
        prefix = f"The special magic numbers for {query} mentioned in the provided text are"
    else:
        question = f"What is the special magic number for {query} mentioned in the provided text?"
        prefix = f"The special magic number for {query} mentioned in the provided text is"
    return lambda n: _Render(f"{NIAH_INTRO}\n{_insert(_noise(n), needles, depths)}\n{question}", prefix, values[0])


def _vt(rng: random.Random, hops: int = 4) -> Renderer:
    value = str(rng.randint(10000, 99999))
    names = [W.var_name(rng) for _ in range(hops + 1)]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    depths = sorted(rng.random() for _ in chain)
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
              f"are assigned the value {value}, they are:")
    return lambda n: _Render(f"{intro}\n\n{_insert(_noise(n), chain, depths)}\n{question}", prefix, names)


def _cwe(rng: random.Random, target: int, num_common: int = 10) -> Renderer:
    freq_common = max(3, min(30, target // 140))
    freq_rare = max(1, min(3, freq_common // 3))
    common = W.unique_words(rng, num_common)
    rare = W.unique_words(rng, len(W.WORDS) // 2, exclude=set(common))
    rare += [W.coded_word(rng, 6) for _ in range(max(0, target // 2))]  # long contexts need more words
    intro = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.")
    question = f"Question: What are the {num_common} most common words in the above list?"
    prefix = f"Answer: The top {num_common} words that appear most often in the list are:"

    def render(n: int) -> _Render:
        items = common * freq_common + [w for w in rare[: -(-n // freq_rare)] for _ in range(freq_rare)][:n]
        random.Random(f"cwe-shuffle-{n}-{common[0]}").shuffle(items)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return _Render(f"{intro}\n{listing}\n{question}", prefix, common)

    return render


def _fwe(rng: random.Random, vocab: int = 200, alpha: float = 2.0) -> Renderer:
    pool: list[str] = []
    while len(pool) < vocab:
        w = W.coded_word(rng, 5)
        if w not in pool:
            pool.append(w)
    weights = [1.0 / (k + 1) ** alpha for k in range(vocab)]
    total = sum(weights)
    intro = ("Read the following coded text and track the frequency of each coded word. Find the three most "
             "frequently appeared coded words.")
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"

    def render(n: int) -> _Render:
        counts = [round(n * w / total) for w in weights]  # Zipf: the top three stay distinct
        items = [w for w, c in zip(pool, counts) for _ in range(c)]
        random.Random(f"fwe-shuffle-{n}-{pool[0]}").shuffle(items)
        return _Render(f"{intro}\n{' ... '.join(items)}\n{question}", prefix, pool[:3])

    return render


def _passkey(rng: random.Random) -> Renderer:
    key = str(rng.randint(10000, 99999))
    depth = rng.random()
    intro = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
             "I will quiz you about the important information there.")
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    return lambda n: _Render(f"{intro}\n{_insert(_noise(n), [needle], [depth])}\nWhat is the pass key?",
                             "The pass key is", [key])


def _renderer(task: str, rng: random.Random, target: int) -> Renderer:
    if task == "niah_single":
        return _niah(rng, 1, 1)
    if task == "niah_multikey":
        return _niah(rng, 4, 1)
    if task == "niah_multivalue":
        return _niah(rng, 1, 4)
    if task == "vt":
        return _vt(rng)
    if task == "cwe":
        return _cwe(rng, target)
    if task == "fwe":
        return _fwe(rng)
    if task == "passkey":
        return _passkey(rng)
    raise ValueError(f"Unknown RULER task {task!r}. Valid: {', '.join(RULER_TASKS + ('passkey',))}")


def encode(tokenizer, text: str, answer_prefix: str, chat: bool) -> list[int]:
    """Token ids exactly as the engine will see them: chat template, then the answer prefix."""
    if chat:
        ids = list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
        return ids + tokenizer.encode(answer_prefix, add_special_tokens=False)
    return tokenizer.encode(f"{text}\n{answer_prefix}", add_special_tokens=False)


def generate_sample(task: str, tokenizer, length: int, seed: int, index: int, chat: bool = True) -> RulerSample:
    """Sample ``index`` of ``task`` with at most ``length`` tokens (within a few tokens of it)."""
    if tokenizer is None:
        raise ValueError(f"RULER task {task!r} needs a tokenizer; this model has none "
                         "(shipped shapes with load_format=dummy take token-id prompts only)")
    rng = random.Random(f"ruler-{task}-{seed}-{index}-{length}")
    render = _renderer(task, rng, length)

    def ids_of(n: int) -> list[int]:
        r = render(n)
        return encode(tokenizer, r.text, r.answer_prefix, chat)

    lo, hi = 0, 16
    if len(ids_of(lo)) > length:
        raise ValueError(f"length={length} is too short for task {task!r}: its bare prompt has "
                         f"{len(ids_of(lo))} tokens")
    while len(ids_of(hi)) <= length:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # invariant: ids_of(lo) fits, ids_of(hi) does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(ids_of(mid)) <= length else (lo, mid)
    r = render(lo)
    return RulerSample(task=task, index=index, seed=seed, target_length=length, prompt_ids=ids_of(lo),
                       text=r.text, answer_prefix=r.answer_prefix, answers=list(r.answers),
                       max_tokens=MAX_NEW_TOKENS[task])
