"""A completions prompt that ends with the start of the sim's own answer is split there, found in
one pass over the prompt with a bounded number of candidate split points."""

from __future__ import annotations

import random

import pytest

from llmgw.simengine import continuation
from llmgw.simengine.text import MAX_WORDS, WORDS, complete, natural_length, prompt_digest

# P as a client might send it: with or without a separator before the answer, empty, not ASCII.
PROMPTS = ["Tell me a story", "Say: ", "Count:\n", "", "ends in a vocabulary word: the", "naïve ☃ 🙂 \ud800"]


def answer_of(prompt: str, words: int = 10_000, ignore_eos: bool = False) -> tuple[str, ...]:
    return complete("m", prompt_digest(prompt), words, ignore_eos=ignore_eos).pieces


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_prompt_ending_with_its_answers_first_words_continues_from_there(prompt: str) -> None:
    pieces = answer_of(prompt)
    assert len(pieces) == natural_length("m", prompt_digest(prompt))
    for m in range(1, len(pieces) + 1):  # the first word, every word after, the last (with its ".")
        received = "".join(pieces[:m])
        split = continuation.split("m", prompt + received)
        assert (split.answer_key, split.at, split.start) == (prompt_digest(prompt), len(prompt), m)
        assert split.prompt_key == prompt_digest(prompt + received)
        rest = complete("m", split.answer_key, 10_000, start=split.start)
        assert received + rest.text == "".join(pieces)


def test_with_ignore_eos_the_answer_goes_on_past_its_natural_end() -> None:
    natural = natural_length("m", prompt_digest("p"))
    received = "".join(answer_of("p", natural + 10, ignore_eos=True))
    assert continuation.split("m", "p" + received, ignore_eos=True).start == natural + 10
    # Without ignore_eos the answer ends at its natural length, with a ".": this is not its start.
    assert continuation.split("m", "p" + received).start != natural + 10
    # The search looks back as far as an answer that ends by itself reaches.
    longer = "".join(answer_of("p", MAX_WORDS + 1, ignore_eos=True))
    assert continuation.split("m", "p" + longer, ignore_eos=True).start < MAX_WORDS + 1


def test_a_prompt_that_continues_nothing_is_taken_whole() -> None:
    another = "".join(answer_of("x", 5))  # the start of another prompt's answer
    for prompt in ("hello world!", "the answer ", "one  two", "Tell me a story" + another):
        split = continuation.split("m", prompt)
        assert (split.prompt_key, split.answer_key, split.start) == (prompt_digest(prompt), prompt_digest(prompt), 0)
    assert continuation.split("m", "hello world!").tried == 0  # no word of the vocabulary ends it
    # One word of the answer changed: not a continuation from where it was.
    pieces = list(answer_of("Tell me a story", 12))
    pieces[6] = " river" if pieces[6] != " river" else " stone"
    assert continuation.split("m", "Tell me a story" + "".join(pieces)).start != 12


def vocabulary_text(rng: random.Random, size: int) -> str:
    words: list[str] = []
    length = 0
    while length < size:
        words.append(rng.choice(WORDS))
        length += len(words[-1]) + 1
    return " ".join(words)


@pytest.mark.parametrize(
    "long",
    [
        "x" * 2_000_000,  # one segment: only its last few characters are looked at
        " ".join(["that"] * 400_000),  # every segment a word with a word inside it ("at")
        vocabulary_text(random.Random(7), 2_000_000),
    ],
)
def test_a_two_megabyte_prompt_is_searched_with_a_bounded_number_of_candidates(long: str) -> None:
    split = continuation.split("m", long)
    assert split.tried <= 2 * MAX_WORDS and split.prompt_key == prompt_digest(long)
    pieces = answer_of(long)
    for m in (1, len(pieces) // 2, len(pieces)):
        received = "".join(pieces[:m])
        split = continuation.split("m", long + received)
        assert (split.answer_key, split.start) == (prompt_digest(long), m)
        assert split.tried <= 2 * MAX_WORDS
