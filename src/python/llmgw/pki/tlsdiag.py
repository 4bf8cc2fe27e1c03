"""Why a TLS handshake on the agent port failed (the agent link's, the gateway link's), as one
line that tells the operator what to do.

Pure: takes the exception, returns text; no I/O. Decides by the attributes OpenSSL gives
(`verify_code` of a certificate the local end refused, `reason` naming an alert the other end
sent), never by message text. The agent's side of the link, a gateway's and the control plane's
call it where a handshake fails, next to `llmgw.pki.tls.send_tls_alert`.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Literal

Side = Literal["client", "server", "gateway"]  # "client": an agent; "gateway": a gateway, also a client

# OpenSSL's X509_V_ERR_* codes (x509_vfy.h), as SSLCertVerificationError.verify_code carries them.
_V_UNTRUSTED = {
    2,  # unable to get issuer certificate
    7,  # certificate signature failure
    18,  # self-signed certificate
    19,  # self-signed certificate in certificate chain
    20,  # unable to get local issuer certificate
    21,  # unable to verify the first certificate
}
_V_NOT_YET_VALID = 9
_V_EXPIRED = 10
_V_PURPOSE = 26
_V_MISMATCH = {62, 64}  # hostname mismatch, IP address mismatch

# Alerts the other end sent, by the reason OpenSSL gives them (ssl.SSLError.reason).
_A_EXPIRED = "SSLV3_ALERT_CERTIFICATE_EXPIRED"
_A_UNKNOWN_CA = "TLSV1_ALERT_UNKNOWN_CA"
_A_REFUSED = {
    "SSLV3_ALERT_BAD_CERTIFICATE": "bad certificate",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE": "unsupported certificate",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "certificate unknown",
    "SSLV3_ALERT_CERTIFICATE_REVOKED": "certificate revoked",
}
_A_CERT_REQUIRED = "TLSV13_ALERT_CERTIFICATE_REQUIRED"
_A_HANDSHAKE_FAILURE = "SSLV3_ALERT_HANDSHAKE_FAILURE"  # TLS 1.2's way of saying "certificate required"
_NO_PEER_CERT = "PEER_DID_NOT_RETURN_A_CERTIFICATE"

_THEIRS = {
    "client": "the control plane's certificate",
    "gateway": "the control plane's certificate",
    "server": "the connecting node's certificate",
    None: "the other end's certificate",
}
_OURS = {
    "client": "this node's certificate",
    "gateway": "this gateway's certificate",
    "server": "this control plane's certificate",
    None: "this end's certificate",
}
_THEY = {
    "client": "the control plane",
    "gateway": "the control plane",
    "server": "the connecting node",
    None: "the other end",
}
_REISSUE_GATEWAY = "issue this gateway a new certificate on the control plane with `llmgw ca issue --gateway NAME`"


def describe_tls_failure(exc: BaseException, *, side: Side | None = None) -> str | None:
    """One line for the operator saying why a handshake was refused and what to do, or None when
    `exc` is not about certificates. `exc` may be the ssl error itself or wrap it (trio's
    BrokenResourceError, an exception group). `side` is which end this is: an expired
    certificate means a different fix when it is the node's than when it is the control plane's;
    without it the message names "the other end"."""
    for err in _ssl_errors(exc):
        if isinstance(err, ssl.SSLCertVerificationError):
            text = _describe_verify(err.verify_code, err.verify_message.rstrip("."), side)
        else:
            text = _describe_alert(err.reason, side)
        if text:
            return text
    return None


def _ssl_errors(exc: BaseException) -> Iterator[ssl.SSLError]:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ssl.SSLError):
            yield e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        group = getattr(e, "exceptions", None)  # BaseExceptionGroup, without needing the 3.10 backport
        if isinstance(group, tuple):
            todo.extend(x for x in group if isinstance(x, BaseException))


def _describe_verify(code: int, message: str, side: Side | None) -> str:
    theirs = _THEIRS[side]
    if code in _V_MISMATCH:  # only a client checks the name, so this is always the server's certificate
        return (
            f"the control plane's certificate does not cover the address this {_dialler(side)} dialled ({message}); on the "
            "control plane add it with `llmgw ca server-cert --san ADDRESS ...` (every address agents dial) and "
            "restart `llmgw server`, or dial an address `llmgw ca show` lists"
        )
    if code in _V_UNTRUSTED:
        fix = {
            "client": "this node's ca.crt is another cluster's, or the control plane's CA was recreated: "
            "add the node again with `llmgw node add USER@HOST --reissue`",
            "gateway": "this gateway's ca.crt is another cluster's, or the control plane's CA was recreated: "
            + _REISSUE_GATEWAY,
            "server": "it was issued by another cluster's CA: add the node again with `llmgw node add USER@HOST --reissue`",
            None: "both ends must hold certificates from one CA: add the node again with `llmgw node add USER@HOST --reissue`",
        }[side]
        return f"{theirs} was not issued by this cluster's CA ({message}); {fix}"
    if code == _V_EXPIRED:
        fix = {
            "client": "on the control plane, `llmgw ca show` says which certificate; reissue the server's with "
            "`llmgw ca server-cert` and restart `llmgw server`",
            "gateway": "on the control plane, `llmgw ca show` says which certificate; reissue the server's with "
            "`llmgw ca server-cert` and restart `llmgw server`",
            "server": "renew it with `llmgw node add USER@HOST --reissue`",
            None: "renew it: `llmgw ca server-cert` for the control plane's, `llmgw node add USER@HOST --reissue` for a node's",
        }[side]
        return f"{theirs} has expired ({message}); {fix}"
    if code == _V_NOT_YET_VALID:
        return (
            f"{theirs} is not valid yet ({message}); a clock is wrong, here or where it was issued: check both "
            "with `timedatectl` and turn on NTP"
        )
    if code == _V_PURPOSE:
        return (
            f"{theirs} is not meant for this use ({message}): the agent port presents server.crt and agents "
            "present node.crt; check which files each side was given"
        )
    return f"{theirs} failed verification ({message}, OpenSSL verify code {code}); inspect it with `openssl x509 -text`"


def _describe_alert(reason: str | None, side: Side | None) -> str | None:
    they, ours = _THEY[side], _OURS[side]
    if side == "gateway" and reason in (_A_CERT_REQUIRED, _A_HANDSHAKE_FAILURE):
        return (
            "the control plane requires a certificate and this gateway sent none (or, over TLS 1.2, ended the "
            "handshake): check that gateway.crt and gateway.key are in its pki directory, or " + _REISSUE_GATEWAY
        )
    if reason == _A_CERT_REQUIRED:  # sent by a server, so received by a client
        return (
            "the control plane requires a node certificate and this agent sent none; check that node.crt and "
            "node.key are in the agent's pki directory, or add the node with `llmgw node add USER@HOST --reissue`"
        )
    if reason == _A_HANDSHAKE_FAILURE and side != "server":
        return (
            "the control plane ended the handshake (handshake failure alert); over TLS 1.2 that is how it "
            "refuses an agent that presented no node certificate: check that node.crt and node.key are in the "
            "agent's pki directory, or add the node with `llmgw node add USER@HOST --reissue`"
        )
    if reason == _NO_PEER_CERT:  # a server's own verdict
        return (
            "a client connected without a certificate; only agents holding a node certificate may connect "
            "(`llmgw node add USER@HOST --reissue` gives a node one)"
        )
    fix = {
        "client": "renew it from the control plane with `llmgw node add USER@HOST --reissue`",
        "gateway": _REISSUE_GATEWAY,
        "server": "reissue it with `llmgw ca server-cert` (`llmgw ca show` shows its dates and addresses)",
        None: "renew it: `llmgw node add USER@HOST --reissue` for a node, `llmgw ca server-cert` for the control plane",
    }[side]
    if reason == _A_EXPIRED:
        return f"{they} refused {ours} as expired; {fix}"
    if reason == _A_UNKNOWN_CA:
        again = (
            _REISSUE_GATEWAY if side == "gateway" else "add the node again with `llmgw node add USER@HOST --reissue`"
        )
        return (
            f"{they} does not trust the CA that issued {ours}: the two hold different clusters' CAs "
            f"(or the CA was recreated); {again}"
        )
    if reason in _A_REFUSED:
        hint = {
            "client": "reissue it with `llmgw node add USER@HOST --reissue`",
            "gateway": _REISSUE_GATEWAY,
            "server": "it may not cover the address the node dials: compare `llmgw ca show` with the node's server URL",
            None: "check both ends' certificates with `llmgw ca show`",
        }[side]
        return f"{they} refused {ours} ({_A_REFUSED[reason]}); {hint}"
    return None


def _dialler(side: Side | None) -> str:
    return "gateway" if side == "gateway" else "node"
