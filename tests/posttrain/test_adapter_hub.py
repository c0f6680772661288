"""Adapters that travel: PEFT's file name, a model card, Hub ids through the local cache, and the upload."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub import constants as hub_constants
from safetensors.torch import load as safetensors_load

from tadm.posttrain import (
    AnchoredBackbone,
    DiffusionGemmaBackbone,
    FusionSpec,
    SplitSpec,
    TimeAnchoredDiffusionGemma,
    attach_adapter,
    generate_blocks,
    load_adapter_config,
    push_adapter_to_hub,
    resolve_adapter,
    save_adapter,
    save_adapter_pretrained,
    write_model_card,
)
from tadm.posttrain.adapter_io import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    CARD_TAGS,
    LEGACY_ADAPTER_WEIGHTS_NAME,
    MODEL_CARD_NAME,
)
from tadm.sampling.entropy_bound import EntropyBoundSampler

from .conftest import build_tiny_gemma, randomize

V, L = 128, 8
HUB_FILES = sorted([ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, MODEL_CARD_NAME])
RESULTS = [{"K": 1, "accuracy": 0.625, "tokens/s": 41.0}, {"K": 2, "accuracy": 0.61, "tokens/s": 63.5}]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _trained(gemma):
    fusion = FusionSpec(rank=8, num_heads=2, gate_bias=-2.0)
    model = AnchoredBackbone(DiffusionGemmaBackbone(gemma), SplitSpec(1, 3), fusion)
    randomize(model.fusion, seed=4, std=0.5)
    return model


def _tokens(model, naive=False):
    """Two canvases at K = 2 (stale anchors, so the fusion's weights matter)."""
    model.fusion_mode = "naive" if naive else "paired"
    prompt = torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(0))
    return generate_blocks(model, prompt, sampler=EntropyBoundSampler(V, num_steps=6), refresh_interval=2,
                           max_new_tokens=2 * L, generator=torch.Generator().manual_seed(1)).sequences


def _assert_same_fusion(a, b):
    sa, sb = a.fusion.state_dict(), b.fusion.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def _assert_same_tensors(a: bytes, b: bytes):
    """Two safetensors files hold the same tensors (their header's key order may differ between writes)."""
    ta, tb = safetensors_load(a), safetensors_load(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _fresh_backbone():
    return DiffusionGemmaBackbone(build_tiny_gemma())


@pytest.mark.slow
def test_round_trip_gives_the_same_fusion_and_tokens(gemma, tmp_path):
    model = _trained(gemma)
    directory = save_adapter_pretrained(tmp_path / "adapter", model, base_model="org/base", card_results=RESULTS)
    assert sorted(p.name for p in directory.iterdir()) == HUB_FILES
    restored = attach_adapter(_fresh_backbone(), directory)
    _assert_same_fusion(model, restored)
    assert torch.equal(_tokens(model), _tokens(restored))
    assert not torch.equal(_tokens(restored), _tokens(restored, naive=True))  # the loaded weights are what differ

    # The transformers-style model saves what it loaded: the same files, and the same tokens again.
    gemma.save_pretrained(tmp_path / "base")
    first = TimeAnchoredDiffusionGemma.from_pretrained(tmp_path / "base", adapter=directory, refresh_interval=2)
    saved = first.save_pretrained(tmp_path / "again", card_results=RESULTS)
    assert sorted(p.name for p in saved.iterdir()) == HUB_FILES
    assert (saved / ADAPTER_CONFIG_NAME).read_text() == (directory / ADAPTER_CONFIG_NAME).read_text()
    _assert_same_tensors((saved / ADAPTER_WEIGHTS_NAME).read_bytes(), (directory / ADAPTER_WEIGHTS_NAME).read_bytes())
    second = TimeAnchoredDiffusionGemma.from_pretrained(tmp_path / "base", adapter=saved, refresh_interval=2)
    run = lambda m: m.generate(torch.randint(3, V, (2, 5), generator=torch.Generator().manual_seed(2)),
                               max_new_tokens=2 * L, max_denoising_steps=6,
                               generator=torch.Generator().manual_seed(3)).sequences
    assert torch.equal(run(first), run(second))


def test_the_old_layout_still_loads(gemma, tmp_path):
    model = _trained(gemma)
    directory = save_adapter(tmp_path / "old", model, base_model="tiny")
    (directory / ADAPTER_WEIGHTS_NAME).rename(directory / LEGACY_ADAPTER_WEIGHTS_NAME)
    restored = attach_adapter(_fresh_backbone(), directory)
    _assert_same_fusion(model, restored)
    assert torch.equal(_tokens(model), _tokens(restored))
    # Saving again writes the new name and removes the old file, so one weights file is read.
    save_adapter(directory, restored, base_model="tiny")
    assert sorted(p.name for p in directory.iterdir()) == sorted([ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME])
    (directory / ADAPTER_WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=f"has no {ADAPTER_WEIGHTS_NAME} \\(nor the older"):
        attach_adapter(_fresh_backbone(), directory)


def _cache_repo(cache: Path, repo_id: str, source: Path) -> Path:
    """Lay ``source``'s files out as huggingface_hub's cache holds a download of ``repo_id`` at main:
    blobs by hash, a snapshot folder of links to them, and refs/main naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hub cache under tmp_path, with HF_HUB_OFFLINE=1: nothing may reach the network."""
    home = tmp_path / "hf-home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    # huggingface_hub reads the environment when it is imported: set its constants as a fresh process would.
    monkeypatch.setattr(hub_constants, "HF_HOME", str(home))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.slow
def test_a_hub_id_loads_from_the_local_cache_offline(gemma, tmp_path, offline_hub):
    model = _trained(gemma)
    source = save_adapter_pretrained(tmp_path / "adapter", model, base_model="org/base")
    snapshot = _cache_repo(offline_hub, "org/tadm-adapter", source)
    assert resolve_adapter("org/tadm-adapter").resolve() == snapshot.resolve()
    assert load_adapter_config("org/tadm-adapter").base_model == "org/base"
    restored = attach_adapter(_fresh_backbone(), "org/tadm-adapter")
    _assert_same_fusion(model, restored)
    assert torch.equal(_tokens(model), _tokens(restored))
    anchored = TimeAnchoredDiffusionGemma.from_pretrained(build_tiny_gemma(), adapter="org/tadm-adapter")
    _assert_same_fusion(model, anchored.anchored)
    with pytest.raises(FileNotFoundError, match="adapter 'org/missing' is not a local directory") as error:
        resolve_adapter("org/missing")
    assert "\n" not in str(error.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_adapter(tmp_path / "no" / "such" / "adapter")


@pytest.fixture
def hub_calls(monkeypatch):
    """HfApi.create_repo and upload_folder replaced by recorders (the uploaded folder's files are read in the call)."""
    calls = {"order": []}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = (repo_id, kwargs)
        calls["order"].append("create_repo")
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kwargs):
        calls["create_branch"] = (repo_id, kwargs)
        calls["order"].append("create_branch")

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        folder = Path(folder_path)
        calls["upload_folder"] = (repo_id, kwargs, {p.name: p.read_bytes() for p in folder.iterdir()})
        calls["order"].append("upload_folder")
        return "commit-info"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_branch", create_branch)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # anything else would fail, not reach the network
    return calls


def test_push_uploads_exactly_the_three_files(gemma, tmp_path, hub_calls):
    model = _trained(gemma)
    source = save_adapter(tmp_path / "run" / "adapter", model, base_model="org/base")
    (source / "training_state.pt").write_bytes(b"stays local")
    assert push_adapter_to_hub("me/tadm-adapter", source, private=True, card_results=RESULTS) == "commit-info"
    assert hub_calls["create_repo"] == ("me/tadm-adapter", dict(private=True, exist_ok=True, repo_type="model"))
    repo_id, options, files = hub_calls["upload_folder"]
    assert repo_id == "me/tadm-adapter" and options["repo_type"] == "model"
    assert sorted(files) == HUB_FILES
    assert files[ADAPTER_WEIGHTS_NAME] == (source / ADAPTER_WEIGHTS_NAME).read_bytes()  # copied as is
    assert files[ADAPTER_CONFIG_NAME] == (source / ADAPTER_CONFIG_NAME).read_bytes()
    card = ModelCard(files[MODEL_CARD_NAME].decode())
    assert card.data.base_model == "org/base" and card.data.library_name == "tadm"
    assert "| 2 | 0.61 | 63.5 |" in card.text and 'adapter="me/tadm-adapter"' in card.text

    # The model's push_to_hub, from an adapter in the old layout: the same three files go up.
    (source / ADAPTER_WEIGHTS_NAME).rename(source / LEGACY_ADAPTER_WEIGHTS_NAME)
    anchored = TimeAnchoredDiffusionGemma.from_pretrained(build_tiny_gemma(), adapter=source)
    assert anchored.push_to_hub("me/other", license="apache-2.0") == "commit-info"
    repo_id, _, pushed = hub_calls["upload_folder"]
    assert repo_id == "me/other" and sorted(pushed) == HUB_FILES
    _assert_same_tensors(pushed[ADAPTER_WEIGHTS_NAME], files[ADAPTER_WEIGHTS_NAME])  # saved again by the model
    assert json.loads(pushed[ADAPTER_CONFIG_NAME]) == json.loads(files[ADAPTER_CONFIG_NAME])
    assert ModelCard(pushed[MODEL_CARD_NAME].decode()).data.license == "apache-2.0"
    plain = TimeAnchoredDiffusionGemma.from_pretrained(build_tiny_gemma(), split=(1, 3))
    with pytest.raises(ValueError, match="no adapter to save"):
        plain.push_to_hub("me/nothing")


def test_a_push_to_a_revision_creates_its_branch_first(gemma, tmp_path, hub_calls):
    """upload_folder(revision=...) fails on a branch that does not exist; transformers creates it first."""
    source = save_adapter(tmp_path / "adapter", _trained(gemma), base_model="org/base")
    push_adapter_to_hub("me/tadm-adapter", source, revision="v2")
    assert hub_calls["order"] == ["create_repo", "create_branch", "upload_folder"]
    assert hub_calls["create_branch"] == ("me/tadm-adapter", dict(branch="v2", repo_type="model", exist_ok=True))
    assert hub_calls["upload_folder"][1]["revision"] == "v2"
    hub_calls["order"].clear()
    push_adapter_to_hub("me/tadm-adapter", source)  # the default branch exists
    push_adapter_to_hub("me/tadm-adapter", source, revision="refs/pr/3")  # a pull request's ref is no branch to make
    assert hub_calls["order"] == ["create_repo", "upload_folder"] * 2


@pytest.mark.parametrize("how", ["connection refused", "offline mode"])
def test_a_push_without_the_hub_is_one_line_naming_repo_and_endpoint(gemma, tmp_path, monkeypatch, how):
    """Used to be a raw ConnectError ('[Errno -2] Name or service not known') naming neither the Hub nor the repo."""
    source = save_adapter(tmp_path / "adapter", _trained(gemma), base_model="org/base")
    if how == "connection refused":  # a real request to a local port nothing listens on: no network needed
        monkeypatch.setattr(hub_constants, "ENDPOINT", "http://127.0.0.1:9")
        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    else:
        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError) as error:
        push_adapter_to_hub("me/tadm-adapter", source)
    message = str(error.value)
    assert "\n" not in message and message.startswith("could not push adapter 'me/tadm-adapter': the Hugging Face Hub "
                                                        f"at {hub_constants.ENDPOINT} cannot be reached ("), message


def test_save_and_push_take_transformers_arguments(gemma, tmp_path, hub_calls, monkeypatch):
    source = save_adapter(tmp_path / "adapter", _trained(gemma), base_model="org/base")
    model = TimeAnchoredDiffusionGemma.from_pretrained(build_tiny_gemma(), adapter=source)
    # save_pretrained(..., push_to_hub=True, repo_id=...): saved, then uploaded with the Hub options.
    saved = model.save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="me/x", commit_message="first",
                                  private=True)
    assert sorted(p.name for p in saved.iterdir()) == HUB_FILES
    repo_id, options, files = hub_calls["upload_folder"]
    assert repo_id == "me/x" and options["commit_message"] == "first" and sorted(files) == HUB_FILES
    assert hub_calls["create_repo"] == ("me/x", dict(private=True, exist_ok=True, repo_type="model"))
    assert files[MODEL_CARD_NAME] == (saved / MODEL_CARD_NAME).read_bytes()  # the card names the repo
    assert 'adapter="me/x"' in files[MODEL_CARD_NAME].decode()
    # Without repo_id the folder's name, as transformers does; other ranks write nothing.
    model.save_pretrained(tmp_path / "my-adapter", push_to_hub=True)
    assert hub_calls["upload_folder"][0] == "my-adapter"
    assert model.save_pretrained(tmp_path / "rank1", False) == tmp_path / "rank1" and not (tmp_path / "rank1").exists()
    # push_to_hub's keywords are transformers'.
    model.push_to_hub("me/y", commit_message="second", commit_description="K = 2", create_pr=True, revision="dev")
    repo_id, options, _ = hub_calls["upload_folder"]
    assert repo_id == "me/y" and (options["commit_message"], options["commit_description"]) == ("second", "K = 2")
    assert options["create_pr"] is True and options["revision"] == "dev"


def test_the_model_card_has_its_yaml_keys_and_the_k_table(gemma, tmp_path):
    base = "google/diffusiongemma-26B-A4B-it"
    directory = save_adapter_pretrained(tmp_path / "a", _trained(gemma), base_model=base, card_results=RESULTS)
    text = (directory / MODEL_CARD_NAME).read_text()
    assert text.startswith("---\n")
    data = ModelCard(text).data.to_dict()
    assert data["base_model"] == base and data["library_name"] == "tadm"
    assert data["tags"] == list(CARD_TAGS)
    assert {"tadm", "time-anchored-diffusion", "diffusion-language-model"} <= set(data["tags"])
    assert "license" not in data  # not known, so not claimed
    table = ["| K | accuracy | tokens/s |", "| --- | --- | --- |", "| 1 | 0.625 | 41 |", "| 2 | 0.61 | 63.5 |"]
    assert "\n".join(table) in text
    assert "1 shared, 3 anchor and 2 denoiser layers" in text
    # The gate bias in adapter_config.json is the initialisation, not a property of the trained weights.
    assert "gate's bias was initialised at -2 before training" in text and "gate bias -2" not in text
    # A Markdown table as given, and a license when one is named.
    markdown = "| K | pass@1 |\n| --- | --- |\n| 4 | 0.5 |"
    write_model_card(directory, card_results=markdown, license="apache-2.0")
    text = (directory / MODEL_CARD_NAME).read_text()
    assert markdown in text and ModelCard(text).data.license == "apache-2.0"
    # No results: no table. A local base path is no Hub id: no base_model key.
    local = save_adapter_pretrained(tmp_path / "b", _trained(gemma), base_model=str(tmp_path / "base"))
    text = (local / MODEL_CARD_NAME).read_text()
    assert "## Results" not in text and "base_model" not in ModelCard(text).data.to_dict()
    with pytest.raises(ValueError, match="card_results must be a Markdown string or a non-empty list of mappings"):
        write_model_card(directory, card_results=[1, 2])


def test_a_relative_local_base_is_not_written_as_the_cards_base_model(gemma, tmp_path, monkeypatch):
    """'tadm posttrain train base.path=runs/base' records runs/base, which reads like a Hub id 'owner/name'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "base").mkdir(parents=True)
    directory = save_adapter_pretrained(tmp_path / "a", _trained(gemma), base_model="runs/base")
    card = ModelCard((directory / MODEL_CARD_NAME).read_text())
    assert "base_model" not in card.data.to_dict() and "`runs/base`" in card.text
    # A Hub id with no directory of that name here is written.
    hub = save_adapter_pretrained(tmp_path / "b", _trained(gemma), base_model="org/base")
    assert ModelCard((hub / MODEL_CARD_NAME).read_text()).data.base_model == "org/base"
