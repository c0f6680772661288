"""``run_posttrain`` end to end on a tiny saved base model: exact resumption and refusal of unsafe states."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tadm.config import PRESET_DIR
from tadm.posttrain import PosttrainTrainer, load_posttrain_config, run_posttrain
from tadm.posttrain.adapter_io import ADAPTER_WEIGHTS_NAME
from tadm.training.checkpoint import STATE_FORMAT, UnsafeStateError, load_training_state
from tadm.training.rundir import LOCK_FILENAME, RunDirLock, RunDirLockedError

from .conftest import build_tiny_gemma, tiny_chat_tokenizer

CHAT = [
    ("the cat", "sat on a mat"),
    ("how are you", "fine thanks"),
    ("what is it", "the dog ran far away"),
    ("hello", "hello how are you"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A saved tiny DiffusionGemma with its chat tokenizer, and a chat JSONL."""
    root = tmp_path_factory.mktemp("posttrain-run")
    build_tiny_gemma(seed=2).save_pretrained(root / "base")
    tiny_chat_tokenizer().save_pretrained(root / "base")
    lines = [json.dumps({"prompt": p, "response": r}) for p, r in CHAT]
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _config(files, out_dir, *extra):
    return load_posttrain_config(PRESET_DIR / "posttrain-tiny.yaml", [
        f"base.path={files / 'base'}", f"data.train_file={files / 'chat.jsonl'}", f"train.out_dir={out_dir}",
        "train.max_steps=4", "train.micro_batch_size=2", "train.grad_accum_steps=2", "train.save_every=2",
        "fusion.rank=8", "rollout.sampler.num_steps=6", "data.canvases_per_example=1", "optim.warmup_steps=1",
        *extra,
    ])


class SimulatedCrash(Exception):
    """Raised from inside a training step to stand for a killed process."""


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_fusion(files, tmp_path, monkeypatch):
    straight = run_posttrain(_config(files, tmp_path / "straight"), log=lambda m: None)

    real_step = PosttrainTrainer.train_step

    def crash_in_step_3(self, micro_batches):
        if self.step == 2:
            raise SimulatedCrash
        return real_step(self, micro_batches)

    monkeypatch.setattr(PosttrainTrainer, "train_step", crash_in_step_3)
    with pytest.raises(SimulatedCrash):
        run_posttrain(_config(files, tmp_path / "resumed"), log=lambda m: None)
    assert load_training_state(tmp_path / "resumed" / "adapter" / "training_state.pt")["step"] == 2
    monkeypatch.undo()

    messages = []
    resumed = run_posttrain(_config(files, tmp_path / "resumed", "train.log_every=1"), log=messages.append)
    assert any(m.startswith("resumed from") and m.endswith("at step 2") for m in messages)
    # without a terminal (no progress bar) each logged step is one readable line
    steps = [m for m in messages if m.startswith("step ")]
    assert steps and all(re.fullmatch(r"step [34]/4 \| loss \d+\.\d{4} \(ce \d+\.\d{4}, kd \d+\.\d{4}\) \| "
                                      r"lr \S+ \| [\d,]+ tok/s", m) for m in steps), steps
    a, b = load_file(straight / ADAPTER_WEIGHTS_NAME), load_file(resumed / ADAPTER_WEIGHTS_NAME)
    assert a.keys() == b.keys() and any(torch.count_nonzero(v) for v in a.values())
    for key in a:
        assert torch.equal(a[key], b[key]), key
    state_a = load_training_state(straight / "training_state.pt")
    state_b = load_training_state(resumed / "training_state.pt")
    assert state_a["step"] == state_b["step"] == 4 and state_a["format"] == STATE_FORMAT
    assert state_a["scheduler"] == state_b["scheduler"]
    assert torch.equal(state_a["generator"], state_b["generator"])


class Payload:
    """Unpickling this object runs code: it writes ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def test_resume_refuses_a_state_that_would_run_code(files, tmp_path):
    cfg = _config(files, tmp_path / "run")
    state_path = tmp_path / "run" / "adapter" / "training_state.pt"
    state_path.parent.mkdir(parents=True)
    marker = tmp_path / "payload-ran"
    torch.save({"format": STATE_FORMAT, "step": 1, "fusion": Payload(marker)}, state_path)

    refused = r"refusing to load .*training_state\.pt: it would import or call 'exec'"
    with pytest.raises(UnsafeStateError, match=refused):
        run_posttrain(cfg, log=lambda m: None)
    assert not marker.exists()  # nothing of the file ran
    assert not (tmp_path / "run" / "adapter" / ADAPTER_WEIGHTS_NAME).exists()  # and nothing was trained

    # The file is live: the unsafe way of reading it would have run the payload.
    torch.load(state_path, weights_only=False)
    assert marker.read_text() == "payload ran"
    os.remove(marker)


def test_resume_refusal_is_a_one_line_cli_error(files, tmp_path, capsys):
    from tadm.cli import main

    out = tmp_path / "run"
    (out / "adapter").mkdir(parents=True)
    marker = tmp_path / "payload-ran"
    torch.save({"format": STATE_FORMAT, "fusion": Payload(marker)}, out / "adapter" / "training_state.pt")
    code = main(["posttrain", "train", str(PRESET_DIR / "posttrain-tiny.yaml"), f"base.path={files / 'base'}",
                 f"data.train_file={files / 'chat.jsonl'}", f"train.out_dir={out}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "refusing to load" in err
    assert not marker.exists()


def test_resume_with_a_changed_fusion_is_refused_in_one_line(files, tmp_path, capsys, monkeypatch):
    from tadm.cli import main

    out = tmp_path / "run"
    run_posttrain(_config(files, out, "train.max_steps=2"), log=lambda m: None)
    capsys.readouterr()
    argv = ["posttrain", "train", str(PRESET_DIR / "posttrain-tiny.yaml"), f"base.path={files / 'base'}",
            f"data.train_file={files / 'chat.jsonl'}", f"train.out_dir={out}", "train.max_steps=4",
            "train.micro_batch_size=2", "train.grad_accum_steps=2", "rollout.sampler.num_steps=6",
            "data.canvases_per_example=1", "optim.warmup_steps=1"]
    assert main([*argv, "fusion.rank=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tadm posttrain train: error: cannot resume from {out / 'adapter' / 'training_state.pt'}: the "
                   "config changed (fusion.rank: saved 8, now 4); start over with another train.out_dir"]
    # the same settings, with the base given as a relative path, resume: two spellings of one directory
    monkeypatch.chdir(files)
    assert main([*argv[:3], "base.path=base", *argv[4:], "fusion.rank=8"]) == 0
    assert load_training_state(out / "adapter" / "training_state.pt")["step"] == 4


def test_a_finished_run_is_not_silently_shortened_overwritten_or_written_over_a_file(files, tmp_path, capsys):
    from tadm.cli import main

    out = tmp_path / "run"
    run_posttrain(_config(files, out, "train.max_steps=2"), log=lambda m: None)
    before = (out / "adapter" / "training_state.pt").read_bytes()
    capsys.readouterr()
    argv = ["posttrain", "train", str(PRESET_DIR / "posttrain-tiny.yaml"), f"base.path={files / 'base'}",
            f"data.train_file={files / 'chat.jsonl'}", "train.micro_batch_size=2", "train.grad_accum_steps=2",
            "rollout.sampler.num_steps=6", "data.canvases_per_example=1", "optim.warmup_steps=1", "fusion.rank=8"]
    (tmp_path / "afile").write_text("user data")
    for extra, message in (
        (["train.max_steps=1"], f"the run in '{out}' has done 2 steps, more than train.max_steps=1"),
        (["train.resume=false"], f"train.out_dir '{out}' already holds a post-training run and train.resume=false "
                                 "would overwrite it"),
    ):
        assert main([*argv, f"train.out_dir={out}", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert (out / "adapter" / "training_state.pt").read_bytes() == before
    assert main([*argv, f"train.out_dir={tmp_path / 'afile'}"]) == 2
    assert capsys.readouterr().err.strip() == (f"tadm posttrain train: error: train.out_dir '{tmp_path / 'afile'}' is "
                                               "an existing file; choose another train.out_dir")


def test_a_pad_id_outside_the_vocabulary_is_one_line(files, tmp_path, capsys):
    from tadm.cli import main

    code = main(["posttrain", "train", str(PRESET_DIR / "posttrain-tiny.yaml"), f"base.path={files / 'base'}",
                 f"data.train_file={files / 'chat.jsonl'}", f"train.out_dir={tmp_path / 'run'}", "data.pad_id=99999"])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Loading weights" not in line]
    assert code == 2 and len(err) == 1 and "data.pad_id 99999 is not a token id of the tokenizer (0.." in err[0]


# ------------------------------------------------------------------------------ one run per out_dir
def _cli_argv(files, out, *extra):
    return ["posttrain", "train", str(PRESET_DIR / "posttrain-tiny.yaml"), f"base.path={files / 'base'}",
            f"data.train_file={files / 'chat.jsonl'}", f"train.out_dir={out}", "train.max_steps=2",
            "train.micro_batch_size=2", "train.grad_accum_steps=2", "rollout.sampler.num_steps=6",
            "data.canvases_per_example=1", "optim.warmup_steps=1", "fusion.rank=8", *extra]


def test_a_second_run_on_a_locked_out_dir_is_refused_naming_the_holder(files, tmp_path, capsys):
    from tadm.cli import main

    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(  # another process holds the out_dir, as a running tadm train or posttrain would
        [sys.executable, "-c", "import sys; from tadm.training.rundir import RunDirLock; RunDirLock(sys.argv[1])"
         ".acquire(); print('locked', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        for extra in ([], ["train.resume=false"]):
            assert main(_cli_argv(files, out, *extra)) == 2
            err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
            assert len(err) == 1 and err[0].startswith("tadm posttrain train: error: train.out_dir "), err
            assert f"'{out}' is in use by another run (PID {holder.pid} on host {socket.gethostname()}" in err[0]
    finally:
        holder.kill()  # SIGKILL: the OS releases the lock
        holder.wait()
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILENAME]  # nothing was written


def test_a_run_holds_its_out_dir_while_it_trains(files, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_step, tried = PosttrainTrainer.train_step, []

    def step_while_locked(self, micro_batches):
        with pytest.raises(RunDirLockedError, match=rf"is in use by another run \(PID {os.getpid()} on host"):
            RunDirLock(out).acquire()  # a second run now: refused
        tried.append(self.step)
        return real_step(self, micro_batches)

    monkeypatch.setattr(PosttrainTrainer, "train_step", step_while_locked)
    run_posttrain(_config(files, out, "train.max_steps=1"), log=lambda m: None)
    assert tried == [0]
    RunDirLock(out).acquire().release()  # released at the end
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


# --------------------------------------------------------------------------- the saved config
def test_the_config_is_replaced_atomically(files, tmp_path, monkeypatch):
    """A kill while the config is saved (here: at the rename of its temporary) leaves the previous one whole."""
    out = tmp_path / "run"
    config_path = out / "adapter" / "posttrain_config.yaml"
    real_replace, saves = os.replace, []

    def replace(src, dst, *args, **kwargs):
        if os.fspath(dst) == str(config_path):
            saves.append(Path(src).read_text())
            if len(saves) == 2:  # the save at step 4: killed before the rename
                raise SimulatedCrash
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(SimulatedCrash):
        run_posttrain(_config(files, out), log=lambda m: None)
    monkeypatch.undo()
    assert config_path.read_text() == saves[0] and not list(config_path.parent.glob(".posttrain_config.yaml.tmp-*"))
    messages = []
    run_posttrain(_config(files, out), log=messages.append)  # resumes from step 2 with the intact config
    assert any(m.startswith("resumed from") and m.endswith("at step 2") for m in messages)


@pytest.mark.parametrize("damage", ["empty", "truncated", "not-a-mapping"])
def test_a_corrupt_saved_config_is_named_as_corrupt(files, tmp_path, capsys, damage):
    from tadm.cli import main

    out = tmp_path / "run"
    run_posttrain(_config(files, out, "train.max_steps=2"), log=lambda m: None)
    path = out / "adapter" / "posttrain_config.yaml"
    text = path.read_text()
    path.write_text({"empty": "", "truncated": text[: len(text) // 3], "not-a-mapping": "- 1\n- 2\n"}[damage])
    capsys.readouterr()
    assert main(_cli_argv(files, out, "train.max_steps=4")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"cannot resume: {path} is corrupt or truncated" in err[0], err
    assert "config changed" not in err[0]
