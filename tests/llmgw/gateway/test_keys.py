"""API keys: hashed storage, revocation at once (the control plane's `KeyRing` and the table it
keeps), and the per-key limits of a gateway's `KeyTable` on a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.gateway.keys import TokenBucket, token_hash
from llmgw.server.errors import ApiKeyError
from llmgw.server.state.keys import KeyRing
from llmgw.server.store import store_path
from llmgw.server.store.asyncstore import AsyncStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_token_bucket_allows_a_minutes_burst_then_refills_at_the_rate() -> None:
    bucket = TokenBucket.full(60, now=0.0)
    assert all(bucket.take(0.0) == 0.0 for _ in range(60))
    assert bucket.take(0.0) == pytest.approx(1.0)
    assert bucket.take(0.5) == pytest.approx(0.5)
    assert bucket.take(1.0) == 0.0
    assert bucket.take(1000.0) == 0.0 and bucket.tokens == pytest.approx(59.0)  # capped at one minute's worth


@pytest.mark.trio
async def test_keys_are_stored_hashed_and_revocation_takes_effect_at_once(tmp_path: Path) -> None:
    ring = KeyRing(AsyncStore.open(tmp_path))
    row, token = await ring.create("team-a", models=["chat"], rate_per_minute=10, max_concurrency=2)
    _, other = await ring.create("team-b")
    assert token.startswith("llmgw-") and row.token_sha256 == token_hash(token)
    assert token.encode() not in store_path(tmp_path).read_bytes()
    assert ring.table.authenticate(token).name == "team-a"
    assert ring.table.authenticate(token + "x") is None
    # A second ring on the same store (a restarted control plane) knows the keys.
    assert KeyRing(AsyncStore.open(tmp_path)).table.authenticate(token).models == ("chat",)
    await ring.revoke("team-a")
    assert ring.table.authenticate(token) is None and ring.table.authenticate(other).name == "team-b"
    assert KeyRing(AsyncStore.open(tmp_path)).table.authenticate(token) is None
    assert [r.revoked_at is not None for r in await ring.rows()] == [True, False]
    with pytest.raises(ApiKeyError, match="exists already"):
        await ring.create("team-a")
    with pytest.raises(ApiKeyError, match="no API key named 'nope'"):
        await ring.revoke("nope")
    with pytest.raises(ApiKeyError, match="not valid"):
        await ring.create("bad name!")
    with pytest.raises(ApiKeyError, match="rate_per_minute"):
        await ring.create("c", rate_per_minute=-1)


@pytest.mark.trio
async def test_rate_and_concurrency_limits_per_key(tmp_path: Path) -> None:
    clock = FakeClock()
    ring = KeyRing(AsyncStore.open(tmp_path), clock=clock)
    table = ring.table
    await ring.create("rated", rate_per_minute=2)
    [rated] = table.keys()
    assert table.admit(rated) is None and table.admit(rated) is None
    limited = table.admit(rated)
    assert limited is not None and "2 requests per minute" in limited.message
    assert limited.retry_after_s == pytest.approx(30.0)
    clock.now += 30.0
    assert table.admit(rated) is None

    await ring.create("narrow", max_concurrency=1)
    narrow = next(k for k in table.keys() if k.name == "narrow")
    assert table.admit(narrow) is None
    refused = table.admit(narrow)
    assert refused is not None and "1 requests in flight" in refused.message
    table.leave(narrow)
    assert table.admit(narrow) is None
