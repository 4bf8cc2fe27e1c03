"""What the sim engine says: the same answer for the same request, tokens counted as words."""

from __future__ import annotations

import subprocess
import sys

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
