"""The cluster page's login codes and sessions, as bookkeeping: times are given, nothing sleeps."""

from __future__ import annotations

import pytest

from llmgw.server.admin.logins import (
    MAX_CODES,
    LoginRefused,
    SessionBook,
    cookie_value,
    csrf_ok,
    set_cookie,
)


def test_a_code_opens_one_session_once() -> None:
    book = SessionBook(code_ttl_s=60, session_ttl_s=3600)
    code = book.mint_code(100.0, can_act=True)
    login = book.redeem(code, 110.0)
    assert login.session.can_act and login.session.expires_at == 3710.0
    assert book.lookup(login.cookie, 120.0) == login.session
    with pytest.raises(LoginRefused) as info:
        book.redeem(code, 111.0)
    assert "used already" in str(info.value) and "llmgw ctl page" in str(info.value)


def test_codes_and_sessions_expire() -> None:
    book = SessionBook(code_ttl_s=60, session_ttl_s=3600)
    late = book.mint_code(0.0)
    with pytest.raises(LoginRefused):
        book.redeem(late, 60.0)
    login = book.redeem(book.mint_code(0.0), 1.0)
    assert not login.session.can_act  # read-only unless asked
    assert book.lookup(login.cookie, 3600.9) is not None
    assert book.lookup(login.cookie, 3601.0) is None
    assert len(book) == 0


def test_the_table_holds_only_hashes_and_the_public_id_is_not_the_cookie() -> None:
    book = SessionBook()
    code = book.mint_code(0.0)
    login = book.redeem(code, 0.0)
    held = repr(book.__dict__)
    assert code not in held and login.cookie not in held
    assert login.session.id.startswith("s-") and login.session.id not in login.cookie
    assert book.lookup("not-" + login.cookie, 0.0) is None
    assert book.end(login.cookie) == login.session and book.lookup(login.cookie, 0.0) is None


def test_unused_codes_are_bounded_oldest_first() -> None:
    book = SessionBook()
    first = book.mint_code(0.0)
    for _ in range(MAX_CODES):
        book.mint_code(0.0)
    with pytest.raises(LoginRefused):
        book.redeem(first, 0.0)


def test_csrf_and_cookie_parsing() -> None:
    book = SessionBook()
    session = book.redeem(book.mint_code(0.0), 0.0).session
    assert csrf_ok(session, session.csrf)
    assert not csrf_ok(session, "") and not csrf_ok(session, session.csrf + "x")
    assert cookie_value("a=1; llmgw_session=abc; b=2") == "abc"
    assert cookie_value("llmgw_sessionx=abc") == "" and cookie_value("") == ""
    header = set_cookie("v", 43200.0)
    assert header == "llmgw_session=v; HttpOnly; SameSite=Strict; Path=/; Max-Age=43200"
