"""Why a handshake failed, in words, without sockets: the ssl error is found behind trio's
wrapping and exception groups, and what is not about certificates is left unsaid. The real
handshakes that produce these errors are in test_tls.py."""

from __future__ import annotations

import ssl

import pytest
import trio

from llmgw.pki.tlsdiag import describe_tls_failure


def verify_error(code: int, message: str) -> ssl.SSLCertVerificationError:
    err = ssl.SSLCertVerificationError(1, f"certificate verify failed: {message}")
    err.verify_code, err.verify_message, err.reason = code, message, "CERTIFICATE_VERIFY_FAILED"
    return err


def alert(reason: str) -> ssl.SSLError:
    err = ssl.SSLError(1, reason.lower())
    err.reason = reason
    return err


@pytest.mark.trio
async def test_describe_finds_the_ssl_error_behind_trio_and_exception_groups() -> None:
    async def handshake_fails() -> None:
        try:
            raise verify_error(10, "certificate has expired")
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError from exc  # what trio.SSLStream raises

    async def unrelated() -> None:
        raise ValueError("unrelated")

    with pytest.RaisesGroup(trio.BrokenResourceError, ValueError) as group:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(unrelated)
            nursery.start_soon(handshake_fails)
    assert describe_tls_failure(group.value, side="server") == (
        "the connecting node's certificate has expired (certificate has expired); renew it with "
        "`llmgw node add USER@HOST --reissue`"
    )


@pytest.mark.parametrize(
    "exc",
    [ConnectionRefusedError(111, "refused"), trio.BrokenResourceError(), alert("UNEXPECTED_EOF_WHILE_READING")],
)
def test_describe_says_nothing_about_what_is_not_a_certificate_problem(exc: BaseException) -> None:
    assert describe_tls_failure(exc) is None


def test_describe_names_the_other_end_when_the_side_is_not_given() -> None:
    text = describe_tls_failure(verify_error(20, "unable to get local issuer certificate"))
    assert text is not None and text.startswith("the other end's certificate was not issued by this cluster's CA")


def test_describe_handshake_failure_alert_is_tls12s_missing_certificate() -> None:
    text = describe_tls_failure(alert("SSLV3_ALERT_HANDSHAKE_FAILURE"), side="client")
    assert text is not None and "presented no node certificate" in text
