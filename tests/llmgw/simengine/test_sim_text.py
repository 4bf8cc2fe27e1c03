"""What the sim engine says: the same answer for the same request, tokens counted as words, an
answer continued from any word."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmgw.simengine import text


def test_same_request_same_answer_and_different_prompts_differ() -> None:
    a = text.complete("m", "hello there", 20)
    assert a == text.complete("m", "hello there", 20)
    assert a.text != text.complete("m", "hello where", 20).text
    assert a.text != text.complete("other-model", "hello there", 20).text


def test_answer_is_stable_across_processes() -> None:
    # Hash randomisation (PYTHONHASHSEED) must not reach the text: another interpreter agrees.
    code = "from llmgw.simengine import text; print(text.complete('m', 'hello there', 20).text)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": ":".join(sys.path), "PYTHONHASHSEED": "12345"},
    )
    assert out.stdout.strip() == text.complete("m", "hello there", 20).text


def test_max_tokens_cuts_the_same_text_and_reports_length() -> None:
    natural = text.natural_length("m", "p")
    assert text.MIN_WORDS <= natural <= text.MAX_WORDS
    short = text.complete("m", "p", 5)
    assert short.tokens == 5 and short.finish_reason == "length"
    full = text.complete("m", "p", 10_000)
    assert full.tokens == natural and full.finish_reason == "stop" and full.text.endswith(".")
    assert full.text.startswith(short.text)
    assert short.pieces[0] == short.pieces[0].strip() and all(p.startswith(" ") for p in short.pieces[1:])
    assert text.count_tokens(short.text) == short.tokens


def test_ignore_eos_gives_exactly_max_tokens() -> None:
    natural = text.natural_length("m", "p")
    long = text.complete("m", "p", natural + 50, ignore_eos=True)
    assert long.tokens == natural + 50 and long.finish_reason == "length"


def test_stop_sequence_cuts_before_it() -> None:
    full = text.complete("m", "p", 12)
    third = full.pieces[2]  # " word"
    cut = text.complete("m", "p", 12, stop=[third, "never-said"])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(third)]
    assert cut.tokens == 2
    # A stop string inside a word leaves that word's beginning as the last piece.
    inside = text.complete("m", "p", 12, stop=[third[2:]])
    assert inside.pieces[-1] == third[:2] and inside.tokens == 3
    assert text.complete("m", "p", 12, stop=["", "zzz"]) == full


def test_count_tokens_splits_on_whitespace() -> None:
    assert text.count_tokens("") == 0
    assert text.count_tokens("  one\ttwo\nthree  ") == 3


@pytest.mark.parametrize("prompt", ["p", "hello there", "a longer prompt, with punctuation"])
def test_an_answer_from_word_k_joins_the_first_k_words_into_the_whole(prompt: str) -> None:
    natural = text.natural_length("m", prompt)
    whole = text.complete("m", prompt, 10_000)
    for k in range(1, natural + 3):  # every word, the natural end, and past it
        partial = text.complete("m", prompt, k).text  # what a client had received
        rest = text.complete("m", prompt, 10_000, start=k)
        assert partial + rest.text == whole.text and rest.finish_reason == "stop"
        assert rest.tokens == max(0, natural - k) and text.count_tokens(partial) == min(k, natural)
        assert all(piece.startswith(" ") for piece in rest.pieces)
    # max_tokens counts the new words; the cut reports "length" as the whole answer's would.
    cut = text.complete("m", prompt, 3, start=5)
    assert cut.pieces == whole.pieces[5:8] and cut.finish_reason == "length"
    last = text.complete("m", prompt, natural - 5, start=5)
    assert last.pieces == whole.pieces[5:] and last.finish_reason == "stop"


def test_an_answer_from_word_k_with_ignore_eos_goes_past_the_natural_end() -> None:
    natural = text.natural_length("m", "p")
    whole = text.complete("m", "p", natural + 20, ignore_eos=True)
    for k in (1, natural - 1, natural, natural + 5):
        partial = text.complete("m", "p", k, ignore_eos=True).text
        rest = text.complete("m", "p", natural + 20 - k, ignore_eos=True, start=k)
        assert partial + rest.text == whole.text and rest.finish_reason == "length" and "." not in rest.text
