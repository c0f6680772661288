"""save_pretrained / from_pretrained / load_model round trips, registries and error messages."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tadm.nn import (
    ADLM,
    MDLM,
    MODEL_BUILDERS,
    MODEL_CLASSES,
    TADM,
    ARTransformer,
    build_model,
    load_model,
)

TINY = {
    "tadm": ("tadm-tiny", TADM),
    "mdlm": ("mdlm-tiny", MDLM),
    "adlm": ("adlm-tiny", ADLM),
    "ar": ("ar-tiny", ARTransformer),
}


def randomize(module: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module.eval()


def outputs(model: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    out = model(z)
    if isinstance(model, TADM):
        return torch.cat([out.log_probs, out.anchor_log_probs], dim=-1)
    if isinstance(model, ADLM):
        return torch.cat(out, dim=-1)
    return out


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))  # mask id 64 excluded


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_round_trip(model_type: str, tmp_path: Path) -> None:
    name, cls = TINY[model_type]
    model = randomize(build_model(name), seed=3)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == model_type
    assert (tmp_path / "model.safetensors").is_file()
    z = tokens()
    if model_type != "ar":
        z[:, ::3] = model.mask_token_id
    expected = outputs(model, z)
    for loaded in (load_model(tmp_path), cls.from_pretrained(str(tmp_path))):
        assert type(loaded) is cls and not loaded.training
        assert loaded.config == model.config
        assert torch.equal(outputs(loaded, z), expected)
    assert MODEL_CLASSES[model_type] is cls


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_the_model_card_says_what_the_model_is_and_how_to_load_it(model_type: str, tmp_path: Path) -> None:
    model = build_model(TINY[model_type][0])
    model.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    params = f"{sum(p.numel() for p in model.parameters()):,}"
    assert f"# A tadm `{model_type}` model" in card and f"with {params} parameters" in card
    assert "load_model(" in card and "library_name: tadm" in card and f"- {model_type}" in card
    assert "pushed to the Hub" not in card and "More Information Needed" not in card


def test_round_trip_keeps_nondefault_config(tmp_path: Path) -> None:
    model = build_model("tadm-tiny", anchor_layers=3, time_conditioning=True, anchor_lm_head=False, mask_token_id=0)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config == model.config and loaded.mask_token_id == 0
    assert loaded.anchor_head is None and len(loaded.anchor.blocks) == 3


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        TADM.from_pretrained(missing)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_model("./does-not-exist")


def test_hub_name_without_download_is_file_not_found() -> None:
    with pytest.raises(FileNotFoundError, match="someone/not-a-tadm-model"):
        load_model("someone/not-a-tadm-model", local_files_only=True)


def test_incomplete_directory(tmp_path: Path) -> None:
    build_model("mdlm-tiny").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_unknown_or_wrong_model_type(tmp_path: Path) -> None:
    build_model("mdlm-tiny").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'mdlm'"):
        TADM.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt-7"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gpt-7") as err:
        load_model(tmp_path)
    assert all(t in str(err.value) for t in ("adlm", "ar", "mdlm", "tadm"))
    del config["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="None"):
        load_model(tmp_path)


def test_unknown_config_key_and_weight_mismatch(tmp_path: Path) -> None:
    build_model("tadm-tiny").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hiden_size": 32}))
    with pytest.raises(ValueError, match="hiden_size"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "anchor_layers": 3}))
    with pytest.raises(RuntimeError, match="anchor.blocks.2"):
        load_model(tmp_path)


def test_builders_registry() -> None:
    expected = {f"{arch}-{size}" for arch in ("tadm", "mdlm", "adlm", "ar") for size in ("small", "tiny")}
    assert set(MODEL_BUILDERS) == expected
    model = build_model("mdlm-tiny", num_layers=2)
    assert isinstance(model, MDLM) and model.layer_split.denoiser == 2
    with pytest.raises(ValueError, match="tadm-tiny") as err:
        build_model("tadm-huge")
    assert "tadm-huge" in str(err.value) and "ar-small" in str(err.value)


def test_model_configs_share_one_size_schema():
    """Every network config takes the shared size fields from one base and validates them there."""
    from tadm.nn import ADLMConfig, ARConfig, DiTSizes, MaskedDiffusionSizes, MDLMConfig, TADMConfig

    shared = {"vocab_size", "hidden_size", "num_heads", "cond_dim", "mlp_ratio", "dropout", "max_seq_len"}
    for config_class in (TADMConfig, MDLMConfig, ADLMConfig, ARConfig):
        assert issubclass(config_class, DiTSizes)
        assert shared <= {f.name for f in dataclasses.fields(config_class)}
        with pytest.raises(ValueError, match=f"{config_class.__name__}.hidden_size"):
            config_class(hidden_size=30, num_heads=4)  # 30 is not divisible by 4
        for layer_field in config_class.layer_fields:
            with pytest.raises(ValueError, match=f"{config_class.__name__}.{layer_field} must be an int >= 1"):
                config_class(**{layer_field: 0})
    for config_class in (TADMConfig, MDLMConfig, ADLMConfig):
        assert issubclass(config_class, MaskedDiffusionSizes)
        assert config_class(vocab_size=10).resolved_mask_token_id == 9
    assert not issubclass(ARConfig, MaskedDiffusionSizes)


@pytest.mark.parametrize("name", sorted(MODEL_BUILDERS))
def test_a_preset_refuses_an_unknown_override_naming_the_valid_keys(name):
    expected = rf"^{name}: unknown \w+Config keys \['nosuch'\]; valid keys: \[.*'hidden_size'"
    with pytest.raises(ValueError, match=expected):
        build_model(name, nosuch=1)
    assert build_model(name, hidden_size=32, num_heads=2).config.hidden_size == 32


def test_a_size_preset_name_is_not_looked_up_on_the_hub() -> None:
    # "tadm-tiny" is also a valid Hub id: without this check it meant about 25 s of offline retries
    with pytest.raises(ValueError, match=r"'tadm-tiny' is a size preset, not a saved model: build it with "
                                         r"tadm\.nn\.build_model\('tadm-tiny'\)"):
        load_model("tadm-tiny")


# ---------------------------------------------------------------------------------- the tokenizer travels with it
def _tokenizer():
    from tadm.training.tokenization import train_bpe_tokenizer

    return train_bpe_tokenizer(["the cat sat on the mat", "a dog ran to the park"] * 4, vocab_size=280)


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hub in a folder: push_to_hub uploads into ROOT/owner/name, downloads read from there (nothing goes out)."""
    from types import SimpleNamespace

    from huggingface_hub import HfApi
    from huggingface_hub.errors import EntryNotFoundError

    import tadm.nn.hub as hub

    root = tmp_path / "hub"

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        shutil.copytree(folder_path, root / repo_id, dirs_exist_ok=True)
        return "commit-info"

    def download(repo_id, filename, **kwargs):
        path = root / repo_id / filename
        if not path.is_file():
            raise EntryNotFoundError(f"{filename} is not in {repo_id}")
        return str(path)

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(hub, "hf_hub_download", download)
    return root


def test_save_pretrained_writes_the_tokenizer_and_a_loaded_model_finds_it(tmp_path: Path) -> None:
    from tadm.specs import find_tokenizer, load_model_and_tokenizer

    tok = _tokenizer()
    model = build_model("tadm-tiny", vocab_size=tok.vocab_size)
    model.save_pretrained(tmp_path / "a", tokenizer=tok)
    loaded = load_model(tmp_path / "a")
    assert loaded.tokenizer_dir == tmp_path / "a"
    assert find_tokenizer(tmp_path / "a").fingerprint() == tok.fingerprint()
    loaded.save_pretrained(tmp_path / "b")  # a loaded model is saved with the tokenizer it came with
    model_b, tok_b = load_model_and_tokenizer(str(tmp_path / "b"))
    assert tok_b.fingerprint() == tok.fingerprint() and model_b.config == model.config
    model.save_pretrained(tmp_path / "c")  # a model built here has none: nothing is made up
    assert load_model(tmp_path / "c").tokenizer_dir is None and not (tmp_path / "c" / "tokenizer.json").exists()


def test_push_to_hub_uploads_the_tokenizer_and_load_model_finds_it_there(fake_hub: Path, capsys) -> None:
    from tadm.cli import main
    from tadm.sampling import generate
    from tadm.specs import find_tokenizer

    tok = _tokenizer()
    build_model("mdlm-tiny", vocab_size=tok.vocab_size).push_to_hub("me/tiny", tokenizer=tok)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tadm_tokenizer.json"} <= {
        p.name for p in (fake_hub / "me" / "tiny").iterdir()}
    model = load_model("me/tiny")
    assert model.tokenizer_dir == fake_hub / "me" / "tiny"
    shared = find_tokenizer("me/tiny")  # what `tadm sample --model me/tiny` decodes with
    out = generate(model, "mdlm", batch_size=1, seq_len=8, num_steps=4, prefix=[shared.bos_id, *shared.encode("the")])
    assert shared.decode_until_eos(out.tokens[0]).startswith("the")
    assert main(["sample", "--model", "me/tiny", "--prompt", "the cat", "-T", "4", "--length", "12"]) == 0
    assert capsys.readouterr().out.startswith("--- sample 0 ---\nthe cat")  # the command line decodes it too
    model.push_to_hub("me/copy")  # pushed again without naming it: the tokenizer goes along
    assert (fake_hub / "me" / "copy" / "tadm_tokenizer.json").is_file()
    build_model("mdlm-tiny").push_to_hub("me/bare")
    assert load_model("me/bare").tokenizer_dir is None  # a repository without one


def test_a_tokenizer_the_model_cannot_read_is_refused(tmp_path: Path) -> None:
    tok = _tokenizer()
    with pytest.raises(ValueError, match=f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary has 65"):
        build_model("tadm-tiny").save_pretrained(tmp_path, tokenizer=tok)
    build_model("ar-tiny", vocab_size=tok.vocab_size - 1).save_pretrained(tmp_path / "ar", tokenizer=tok)  # no mask
    with pytest.raises(TypeError, match="tokenizer must have save"):
        build_model("tadm-tiny").save_pretrained(tmp_path, tokenizer="gpt2")


def test_a_missing_path_under_a_local_folder_is_a_local_error_not_a_hub_lookup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tadm.nn.hub as hub
    from tadm.specs import check_model_source

    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "hf_hub_download", lambda *a, **k: pytest.fail("looked up on the Hub"))
    message = "model directory 'runs/typo' does not exist (its folder 'runs' does, so this is a local path"
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        load_model("runs/typo")
    with pytest.raises(FileNotFoundError, match=re.escape(message)):  # the command line's check says the same
        check_model_source("runs/typo")
