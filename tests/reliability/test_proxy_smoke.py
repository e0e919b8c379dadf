"""The fault proxy itself, against a real redis-server (fast; part of the default suite): it forwards, delays
replies, blackholes (clients see half-open connections until their socket timeout) and resets connections."""
from __future__ import annotations

import time

import pytest
import redis as syncredis
from redis.backoff import NoBackoff
from redis.retry import Retry

from reliability.proxy import FaultProxy
from shared.procutil import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def proxied(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    proxy = FaultProxy("127.0.0.1", server.port).start()
    try:
        yield proxy
    finally:
        proxy.stop()
        server.stop()


def _client(proxy: FaultProxy, timeout: float = 1.0) -> syncredis.Redis:
    return syncredis.Redis.from_url(proxy.url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                   retry=Retry(NoBackoff(), 0))


def test_forwards_and_delays_replies(proxied):
    r = _client(proxied)
    assert r.ping() and r.set("k", "v") and r.get("k") == b"v"
    t0 = time.perf_counter()
    r.ping()
    fast = time.perf_counter() - t0
    proxied.latency(0.2)
    t0 = time.perf_counter()
    assert r.get("k") == b"v"
    slow = time.perf_counter() - t0
    proxied.latency(0.0)
    assert fast < 0.1 and 0.19 <= slow < 0.8


def test_blackhole_is_half_open_until_the_client_times_out(proxied):
    r = _client(proxied, timeout=0.5)
    assert r.ping()
    proxied.blackhole()
    time.sleep(0.05)
    with pytest.raises(syncredis.TimeoutError):
        r.ping()
    r.close()  # what a client does after a timeout: drop the connection
    time.sleep(0.2)
    st = proxied.stats()
    assert st["watched"] == 1 and len(st["detections_s"]) == 1 and 0.4 <= st["detections_s"][0] < 2.0
    fresh = _client(proxied, timeout=0.3)
    with pytest.raises(syncredis.TimeoutError):  # new connections are accepted but go nowhere
        fresh.ping()
    proxied.heal()
    assert _client(proxied).ping()


def test_reset_all_sends_rst(proxied):
    r = _client(proxied)
    assert r.ping()
    assert proxied.reset_all() == 1
    time.sleep(0.05)
    # redis-py notices the reset connection when it takes it from the pool and reconnects (no retry needed)
    assert r.ping() and proxied.stats()["accepted"] == 2 and proxied.stats()["open"] == 1
