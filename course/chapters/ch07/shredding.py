"""Crypto-shredding, chapter 07's demo: a person's fields sealed with a key of their own, kept outside
the event store; deleting the key forgets them while the events stay (Verraes, 2019).

The cipher here is a **stand-in** made from the standard library, because the course installs no
crypto package: an HMAC-SHA-256 keystream XORed with the text, then an HMAC tag over nonce and
ciphertext (encrypt-then-MAC, with separate keys derived for each). It shows the idea and nothing
more. Production code uses AES-GCM from the ``cryptography`` package (``AESGCM``) or the encrypt
call of its key management service, never a home-made cipher.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets

NONCE = 16
TAG = 16


class KeyStore:
    """One key per data subject, outside the event store (a stand-in for a KMS or a vault)."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}

    def key_for(self, subject: str) -> bytes:
        """The subject's key, made on first use."""
        return self._keys.setdefault(subject, secrets.token_bytes(32))

    def forget(self, subject: str) -> bool:
        """Delete the subject's key (the erasure); whether there was one."""
        return self._keys.pop(subject, None) is not None

    def get(self, subject: str) -> bytes | None:
        return self._keys.get(subject)


def _derive(key: bytes, purpose: bytes) -> bytes:
    return hmac.new(key, purpose, hashlib.sha256).digest()


def _keystream(key: bytes, nonce: bytes, n: int) -> bytes:
    blocks = (
        hmac.new(key, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest() for i in range(n // 32 + 1)
    )
    return b"".join(blocks)[:n]


def seal(key: bytes, fields: dict) -> str:
    """``fields`` encrypted and authenticated with ``key``, as base64 text for a JSON event."""
    plain = json.dumps(fields, sort_keys=True).encode()
    nonce = secrets.token_bytes(NONCE)
    body = bytes(
        a ^ b for a, b in zip(plain, _keystream(_derive(key, b"enc"), nonce, len(plain)), strict=True)
    )
    tag = hmac.new(_derive(key, b"mac"), nonce + body, hashlib.sha256).digest()[:TAG]
    return base64.b64encode(nonce + body + tag).decode()


def unseal(key: bytes, token: str) -> dict:
    """The fields :func:`seal` sealed; ``ValueError`` if the text was altered or the key is another."""
    raw = base64.b64decode(token)
    nonce, body, tag = raw[:NONCE], raw[NONCE:-TAG], raw[-TAG:]
    if not hmac.compare_digest(
        tag, hmac.new(_derive(key, b"mac"), nonce + body, hashlib.sha256).digest()[:TAG]
    ):
        raise ValueError("not sealed with this key")
    return json.loads(
        bytes(a ^ b for a, b in zip(body, _keystream(_derive(key, b"enc"), nonce, len(body)), strict=True))
    )


def reveal(keys: KeyStore, data: dict) -> dict | None:
    """The personal fields of an event's ``data`` (``subject`` + ``pii``), or None once the key is gone."""
    key = keys.get(data["subject"])
    return None if key is None else unseal(key, data["pii"])
