"""The RULER generator: target lengths for the SmolLM2 tokenizer, the answer is in the prompt,
seeded determinism, and RULER's scoring on known outputs."""

from __future__ import annotations

import pytest

from experiments.ruler import RULER_TASKS, generate_sample, score_sample, string_match_all, string_match_part

TASKS = list(RULER_TASKS) + ["passkey"]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [512, 2048, 4096])
def test_length_hits_target(task, length, smollm2_tokenizer) -> None:
    s = generate_sample(task, smollm2_tokenizer, length, seed=0, index=0)
    assert length - 8 <= s.num_tokens <= length, (task, length, s.num_tokens)


@pytest.mark.parametrize("task", TASKS)
def test_answer_is_in_prompt_and_seed_is_deterministic(task, smollm2_tokenizer) -> None:
    a = generate_sample(task, smollm2_tokenizer, 1024, seed=3, index=1)
    b = generate_sample(task, smollm2_tokenizer, 1024, seed=3, index=1)
    c = generate_sample(task, smollm2_tokenizer, 1024, seed=4, index=1)
    prompt = smollm2_tokenizer.decode(a.prompt_ids)
    assert a.answers and all(ans in prompt for ans in a.answers)
    assert a == b
    assert (c.prompt_ids, c.answers) != (a.prompt_ids, a.answers)


def test_tokenizerless_model_gets_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs a tokenizer"):
        generate_sample("niah_single", None, 512, 0, 0)


def test_scoring_on_known_outputs() -> None:
    assert score_sample("niah_single", " 1234567.", ["1234567"]) == 1.0
    assert score_sample("niah_multivalue", "11, 22 and 99", ["11", "22", "33", "44"]) == 0.5
    assert score_sample("cwe", "Apple, PEAR", ["apple", "pear", "fig", "kiwi"]) == 0.5
    assert score_sample("vt", "nothing", ["ABCDE"]) == 0.0
    assert string_match_all(["a b", "c"], [["a", "b"], ["c", "d"]]) == pytest.approx(0.75)
    assert string_match_part(["a b", "x"], [["a", "z"], ["c", "d"]]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="Valid"):
        score_sample("nope", "", ["x"])
