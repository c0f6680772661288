"""``tadm.hf.hub_reachable``: one probe of the Hub's host, skipped offline and behind a proxy."""

from __future__ import annotations

import logging
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


def test_a_tadm_checkpoints_tokenizer_loads_without_the_model_type_warning(tmp_path) -> None:
    from tests.eval.test_evaluator import tiny_diffusion, tiny_tokenizer

    tiny_diffusion("tadm", max_seq_len=32).save_pretrained(tmp_path)
    tiny_tokenizer().save(tmp_path)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        tok = hf.load_hf_tokenizer(tmp_path)
    finally:
        root.removeHandler(handler)
    assert tok("the cat").input_ids == tiny_tokenizer().encode("the cat")
    assert not [r for r in records if "model of type" in r.getMessage()]
    config_logger = logging.getLogger("transformers.configuration_utils")
    assert hf._no_model_type_warning not in config_logger.filters  # removed again
    assert not hf._no_model_type_warning(logging.makeLogRecord({"msg": "You are using a model of type `tadm` ..."}))
    assert hf._no_model_type_warning(logging.makeLogRecord({"msg": "something else"}))


def test_a_model_directory_without_tokenizer_files_is_refused(tmp_path) -> None:
    """From config.json alone transformers builds a tokenizer of five special tokens that encodes every text to
    nothing; a directory without a tokenizer file is refused by name instead."""
    from tadm.posttrain.backbone import tiny_diffusion_gemma_config

    tiny_diffusion_gemma_config().save_pretrained(tmp_path / "base")
    with pytest.raises(FileNotFoundError) as error:
        hf.load_hf_tokenizer(tmp_path / "base")
    message = str(error.value)
    assert "\n" not in message and f"'{tmp_path / 'base'}' is a model directory without a tokenizer" in message
    assert "tokenizer.json, tokenizer_config.json, tokenizer.model" in message
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a saved Hugging Face directory"):
        hf.load_hf_tokenizer(tmp_path / "empty")
