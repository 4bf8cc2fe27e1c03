"""Engine keys at rest: each replica's engine key sealed for the database, and the secret that
opens them, kept in its own file.

A replica's engine requires a key of its own, so that only the gateway uses the engine's port.
The control plane draws it at random when it places the replica, gives it to the replica's
agents and sends it with each request. It must outlive a control-plane restart: the engines
that ran meanwhile are adopted, and must be called with the key they were started with.

The database holds each key sealed: AES-256-GCM under a 256-bit secret, a fresh 96-bit nonce
per seal, the replica id as associated data (a sealed key copied into another replica's row
does not open). The secret lives in STATE_DIR/engine-keys.secret (0600, 64 hex digits), never
in the database: whoever reads llmgw.db, or a backup of it, alone learns no key.

Why sealed rather than derived (HMAC of the secret, the replica id and a nonce): a database of
an earlier version holds the plain keys of engines that are running now, and no derivation
gives those back. Sealing takes them as they are: at the first start they are sealed in place
and scrubbed from the file, and their engines go on with the same key, without a restart. One
format for old and new keys, and one more file to keep (it never changes once made).

The secret file is made by `llmgw ca init`, or by the first start that finds none and no sealed
key. Missing while the database holds sealed keys, it stops the start (`SecretMissing`), with
how to restore it or, if it is lost, how to start over: an empty file is the operator's word
that it is lost, and a new secret is made in it. A key that does not open (sealed under a lost
secret) is then replaced by the caller, and that replica's engine restarts with the new one.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from llmgw import paths, private
from llmgw.errors import MachineError

SECRET_BYTES = 32
NONCE_BYTES = 12
PREFIX = "aes256gcm:"  # what a sealed key starts with: a later format gets another prefix
_AAD = b"llmgw engine key\0"  # then the replica id: a key sealed for one replica opens for it alone
WHAT = "the secret that seals the engine keys"


class KeySeal:
    """Seals and opens engine keys under one secret. Holds the secret; never logs or prints it."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"an engine-key secret is {SECRET_BYTES} bytes, not {len(secret)}")
        self._aead = AESGCM(secret)

    def __repr__(self) -> str:
        return "KeySeal(<redacted>)"

    def seal(self, replica_id: str, key: str) -> str:
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, key.encode(), _AAD + replica_id.encode())
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode()

    def open(self, replica_id: str, sealed: str) -> str | None:
        """The key, or None if `sealed` does not open: another secret sealed it, or another replica
        was its owner, or it was changed."""
        if not sealed.startswith(PREFIX):
            return None
        try:
            raw = base64.urlsafe_b64decode(sealed[len(PREFIX) :].encode())
            return self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], _AAD + replica_id.encode()).decode()
        except (binascii.Error, ValueError, InvalidTag):  # UnicodeDecodeError is a ValueError
            return None


def generate(state_dir: Path) -> bool:
    """Make the secret file if there is none (True if this call made it); an existing one is kept."""
    path = paths.engine_keys_secret_path(state_dir)
    if path.exists():
        return False
    with contextlib.suppress(FileExistsError):  # another process made it meanwhile: that one stays
        paths.write_private(path, _new_secret_text(), exclusive=True)
        return True
    return False


def load(state_dir: Path, *, sealed_keys: int) -> KeySeal:
    """The secret of this state directory, made if there is none and no key (`sealed_keys` of
    them in the database) needs it, or if the file is empty."""
    path = paths.engine_keys_secret_path(state_dir)
    try:
        text = private.read(path, WHAT).decode("ascii", "replace").strip()
    except FileNotFoundError:
        if sealed_keys:
            raise SecretMissing(path, sealed_keys) from None
        generate(state_dir)
        return load(state_dir, sealed_keys=0)
    except PermissionError:
        raise MachineError(f"cannot read {path} ({WHAT}): permission denied; run as the user that owns it") from None
    if not text:
        paths.write_private(path, _new_secret_text())  # the operator's word: the old one is lost
        return load(state_dir, sealed_keys=0)
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise MachineError(
            f"{path} is not an engine-key secret ({SECRET_BYTES * 2} hexadecimal digits); restore it from your copy "
            'of the state directory (docs/operations.md, "Backing up and restoring the control plane\'s state")'
        )
    return KeySeal(secret)


def _new_secret_text() -> bytes:
    return (secrets.token_bytes(SECRET_BYTES).hex() + "\n").encode()


class SecretMissing(MachineError):
    """The database holds sealed keys and the secret that opens them is gone: the operator
    restores the file, or says it is lost."""

    def __init__(self, path: Path, sealed_keys: int) -> None:
        self.path = path
        self.sealed_keys = sealed_keys
        super().__init__(
            f"{path} ({WHAT}) is missing, and the control plane's store ({path.parent / 'llmgw.db'}, or the "
            f"PostgreSQL database of [store] url) holds the engine keys of {sealed_keys} "
            "replica(s) sealed with it. Restore it, mode 0600, from your copy of the state directory "
            "(docs/operations.md, \"Backing up and restoring the control plane's state\"), and start again. If it "
            f"is lost, start with a new one: `install -m 600 /dev/null {path}`; those replicas then get new keys "
            "and their engines restart once"
        )
