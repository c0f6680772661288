"""``tadm.hf.hub_reachable``: one probe of the Hub's host, skipped offline and behind a proxy."""

from __future__ import annotations

import socket

import pytest

import tadm.hf as hf


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch: pytest.MonkeyPatch):
    for name in ("HF_HUB_OFFLINE", *hf.PROXY_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    hf.hub_reachable.cache_clear()
    yield
    hf.hub_reachable.cache_clear()


def test_the_endpoint_host_is_probed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    probed = []

    def refuse(address, timeout):
        probed.append(address)
        raise ConnectionRefusedError

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(hf.constants, "ENDPOINT", "https://hub.example.org:8443")
    assert hf.hub_reachable() is False and hf.hub_reachable() is False
    assert probed == [("hub.example.org", 8443)]


def test_offline_and_proxy_settings_are_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("probed"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hf.hub_reachable() is False
    hf.hub_reachable.cache_clear()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example.org:3128")
    assert hf.hub_reachable() is True  # the proxy decides; the Hub client reports its errors
