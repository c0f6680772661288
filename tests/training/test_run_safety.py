"""Run-directory safety: the out_dir lock, leftovers of killed saves, metrics on resume, Ctrl-C, tokenizer provenance.

Several tests start real processes: one holding a run directory's lock, and training runs killed
(SIGKILL) in the middle of a save.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tadm.cli import main
from tadm.config import ExperimentConfig, save_config
from tadm.training import objectives
from tadm.training.checkpoint import CorruptStateError, load_training_state, save_training_state
from tadm.training.metrics import MetricsLogger, read_metrics
from tadm.training.provenance import PROVENANCE_FILENAME, TokenizerMismatchError
from tadm.training.rundir import (LOCK_FILENAME, RunDirLock, RunDirLockedError, pid_alive,
                                  remove_stale_temporaries, temporary_path)
from tadm.training.trainer import TrainingInterrupted, TrainResult, train
from tests.training.test_checkpoint import FIXTURE, assert_same_weights, run_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _dead_pid() -> int:
    """The PID of a process that has exited."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(done.stdout)
    assert not pid_alive(pid)
    return pid


@pytest.fixture(scope="module", autouse=True)
def _one_thread_like_the_killed_runs():
    """The killed runs use one thread (``ENV``); so do the in-process runs they are compared with bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, cache_dir: Path) -> TrainResult:
    """An uninterrupted 6-step run (saving every 2 steps) to compare interrupted ones with."""
    return train(run_config(tmp_path_factory.mktemp("straight"), tokenizer_dir, cache_dir, "train.save_every=2"))


# ------------------------------------------------------------------------------------- the lock
@pytest.mark.slow
def test_a_second_run_on_a_locked_out_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tadm.training.rundir import RunDirLock; RunDirLock(sys.argv[1])"
         ".acquire(); print('locked', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        second = subprocess.run([sys.executable, "-m", "tadm", "train", "tadm-tiny", f"train.out_dir={out}",
                                 "train.device=cpu"], capture_output=True, text=True, env=ENV, timeout=120)
        assert second.returncode == 2
        line = _one_line(second.stderr)
        assert f"is in use by another run (PID {holder.pid} on host {socket.gethostname()}" in line, line
        # --resume is refused alike, before the (absent) state is looked at
        code, _, err = _run_cli(capsys, "train", "tadm-tiny", f"train.out_dir={out}", "--resume")
        assert code == 2 and f"PID {holder.pid}" in _one_line(err)
    finally:
        holder.kill()  # SIGKILL: the OS releases the lock
        holder.wait()
    with RunDirLock(out) as lock:
        assert f"PID {os.getpid()} " in lock.path.read_text()
        with pytest.raises(RunDirLockedError, match=f"PID {os.getpid()} on host"):
            RunDirLock(out).acquire()  # another open file, even in this process
    assert (out / LOCK_FILENAME).is_file()


def test_out_dir_that_is_a_file_or_read_only(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "taken"
    blocker.write_text("user data")
    code, _, err = _run_cli(capsys, "train", "tadm-tiny", f"train.out_dir={blocker}")
    assert code == 2 and f"train.out_dir '{blocker}' is an existing file, not a directory" in _one_line(err)
    code, _, err = _run_cli(capsys, "train", "tadm-tiny", f"train.out_dir={blocker / 'sub'}")
    assert code == 2 and "cannot be created (Not a directory)" in _one_line(err)
    assert blocker.read_text() == "user data"
    read_only, real_access = tmp_path / "ro", os.access
    # a read-only directory, also for root (whom chmod does not stop)
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != read_only and real_access(path, mode, **kw))
    code, _, err = _run_cli(capsys, "train", "tadm-tiny", f"train.out_dir={read_only}")
    assert code == 2 and "is read-only; choose a writable train.out_dir" in _one_line(err)


# --------------------------------------------------------------------------- leftovers of saves
def test_stale_temporaries_of_dead_writers_are_removed(tmp_path: Path) -> None:
    dead, live = _dead_pid(), os.getpid()
    (tmp_path / f".training_state.pt.tmp-{dead}").write_bytes(b"half a state")
    (tmp_path / f".final.tmp-{dead}").mkdir()
    (tmp_path / f".final.tmp-{dead}" / "model.safetensors").write_bytes(b"half")
    (tmp_path / "final").mkdir()
    (tmp_path / f".final.old-{dead}").mkdir()  # final/ exists: the old copy goes
    (tmp_path / f".best.old-{dead}").mkdir()  # best/ is missing: the old copy is put back
    (tmp_path / f".best.old-{dead}" / "config.json").write_text("{}")
    (tmp_path / f".training_state.pt.tmp-{live}").write_bytes(b"being written")
    (tmp_path / f".final.tmp-{live}").mkdir()
    (tmp_path / "notes.tmp-x").write_text("not ours")
    cleaned = remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in cleaned) == sorted(
        [f".training_state.pt.tmp-{dead}", f".final.tmp-{dead}", f".final.old-{dead}", f".best.old-{dead}"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["best", "final", "notes.tmp-x", f".training_state.pt.tmp-{live}", f".final.tmp-{live}"])
    assert (tmp_path / "best" / "config.json").read_text() == "{}"
    assert temporary_path(tmp_path / "final").name == f".final.tmp-{live}"
    # a successful save also cleans: a dead writer's leftover beside it goes, the live one stays
    (tmp_path / f".training_state.pt.tmp-{dead}").write_bytes(b"x")
    save_training_state({"format": 1, "step": 1}, tmp_path / "training_state.pt")
    assert not (tmp_path / f".training_state.pt.tmp-{dead}").exists()
    assert (tmp_path / f".final.tmp-{live}").is_dir()


KILLER = textwrap.dedent("""
    import os, signal, sys
    import torch
    from tadm.config import load_config
    from tadm.training import checkpoint
    from tadm.training.trainer import train

    mode, config = sys.argv[1], sys.argv[2]
    real_save, real_config = torch.save, checkpoint.save_config

    def save_then_die(obj, f, *args, **kwargs):  # the state of step 4 is half written when the process dies
        real_save(obj, f, *args, **kwargs)
        if obj.get("step") == 4:
            os.kill(os.getpid(), signal.SIGKILL)

    def config_then_die(cfg, path):  # final/ is assembled in its temporary directory when the process dies
        real_config(cfg, path)
        os.kill(os.getpid(), signal.SIGKILL)

    if mode == "state":
        torch.save = save_then_die
    else:
        checkpoint.save_config = config_then_die
    train(load_config(config))
""")


def _killed_run(cfg: ExperimentConfig, tmp_path: Path, mode: str) -> None:
    save_config(cfg, tmp_path / "run.yaml")
    (tmp_path / "killer.py").write_text(KILLER)
    done = subprocess.run([sys.executable, str(tmp_path / "killer.py"), mode, str(tmp_path / "run.yaml")],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["state", "final"])
def test_a_run_killed_during_a_save_resumes_exactly_and_its_leftovers_go(
    mode: str, straight: TrainResult, tmp_path: Path, tokenizer_dir: Path, cache_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "run"
    cfg = run_config(out, tokenizer_dir, cache_dir, "train.save_every=2")
    _killed_run(cfg, tmp_path, mode)
    leftovers = [p.name for p in out.iterdir() if ".tmp-" in p.name]
    assert len(leftovers) == 1 and leftovers[0].startswith(".training_state.pt" if mode == "state" else ".final")
    saved_step = load_training_state(out / "training_state.pt")["step"]
    assert saved_step == (2 if mode == "state" else 6) and not (out / "final").exists()

    resumed = train(cfg, resume=True)
    assert f"removed 1 leftover(s) of interrupted saves: {leftovers[0]}" in capsys.readouterr().out
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert resumed.start_step == saved_step and resumed.losses == straight.losses[saved_step:]
    logged = [r["loss"] for r in read_metrics(out / "metrics.jsonl", "train")]
    assert logged == straight.losses  # one history: steps 1..saved_step from the killed run, then the resumed one
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl", "val")] == [0, 6]
    assert_same_weights(straight.model_dir, resumed.model_dir)


# ----------------------------------------------------------------------------- metrics on resume
def test_metrics_are_rewritten_atomically_on_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = MetricsLogger(tmp_path)
    for step in (1, 2, 3):
        log.log(step, "train", {"loss": 0.5 * step})
    before = (tmp_path / "metrics.jsonl").read_bytes()

    def killed(*args: object) -> None:
        raise KeyboardInterrupt  # the moment a kill would land: after writing the new file, before the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsLogger(tmp_path, resume_step=1)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # untouched, not truncated
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left


def test_a_cut_off_last_metrics_line_is_dropped_with_a_notice(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train", "loss": 1.0}\n{"step": 2, "split": "train", "lo')
    assert read_metrics(path) == [{"step": 1, "split": "train", "loss": 1.0}]
    notices: list[str] = []
    MetricsLogger(tmp_path, resume_step=2, notice=notices.append)
    assert len(notices) == 1 and "dropped its last line, cut off by a killed run" in notices[0]
    assert path.read_text() == '{"step": 1, "split": "train", "loss": 1.0}\n'
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON record"):
        MetricsLogger(tmp_path, resume_step=2)


@pytest.mark.slow
def test_resume_after_a_cut_off_metrics_line(straight: TrainResult, tmp_path: Path, tokenizer_dir: Path,
                                             cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 2 steps are warmup: the same updates as in the 6-step schedule
    train(run_config(tmp_path, tokenizer_dir, cache_dir, "train.save_every=2", "train.max_steps=2"))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "split": "tr')
    capsys.readouterr()
    resumed = train(run_config(tmp_path, tokenizer_dir, cache_dir, "train.save_every=2"), resume=True)
    assert "dropped its last line, cut off by a killed run" in capsys.readouterr().out
    assert resumed.losses == straight.losses[2:]
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl", "train")] == straight.losses


# ------------------------------------------------------------------------------------------ Ctrl-C
def _interrupt_at(monkeypatch: pytest.MonkeyPatch, step: int, how: str) -> None:
    """Ctrl-C during optimizer step ``step`` (a SIGINT to this process, or a KeyboardInterrupt raised there)."""
    real = objectives.OBJECTIVES["tadm"]
    calls = {"n": 0}

    def objective(model, *args, **kwargs):
        calls["n"] += model.training
        if calls["n"] == 2 * step:  # 2 micro-batches per step
            if how == "signal":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise KeyboardInterrupt
        return real(model, *args, **kwargs)

    monkeypatch.setitem(objectives.OBJECTIVES, "tadm", objective)


@pytest.mark.slow
def test_ctrl_c_saves_the_state_prints_the_resume_command_and_exits_130(
    straight: TrainResult, tmp_path: Path, tokenizer_dir: Path, cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = run_config(tmp_path / "run", tokenizer_dir, cache_dir, "train.save_every=2")
    save_config(cfg, tmp_path / "run.yaml")
    handler = signal.getsignal(signal.SIGINT)
    _interrupt_at(monkeypatch, 3, "signal")
    code, _, err = _run_cli(capsys, "train", str(tmp_path / "run.yaml"), "train.max_steps=6")
    assert code == 130
    assert err.splitlines()[-1] == (f"tadm train: interrupted at step 3/6; training state saved to "
                                    f"{tmp_path / 'run' / 'training_state.pt'}; resume with: tadm train "
                                    f"{tmp_path / 'run.yaml'} train.max_steps=6 --resume")
    assert load_training_state(tmp_path / "run" / "training_state.pt")["step"] == 3
    assert signal.getsignal(signal.SIGINT) is handler  # restored after the loop
    monkeypatch.undo()
    resumed = train(cfg, resume=True)
    assert resumed.losses == straight.losses[3:]
    assert_same_weights(straight.model_dir, resumed.model_dir)


def test_ctrl_c_outside_a_step_boundary(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path,
                                        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path / "run", tokenizer_dir, cache_dir, "train.save_every=2")
    save_config(cfg, tmp_path / "run.yaml")
    _interrupt_at(monkeypatch, 3, "raise")
    with pytest.raises(KeyboardInterrupt) as caught:
        train(cfg)
    assert not isinstance(caught.value, TrainingInterrupted)
    _interrupt_at(monkeypatch, 1, "raise")
    code, _, err = _run_cli(capsys, "train", str(tmp_path / "run.yaml"), "--resume")
    assert code == 130 and err.splitlines()[-1] == (
        f"tadm train: interrupted; the last training state is {tmp_path / 'run' / 'training_state.pt'}; "
        f"resume with: tadm train {tmp_path / 'run.yaml'} --resume")


@pytest.mark.parametrize("rank, world, per_node, launch", [
    (0, 2, 2, "torchrun --nproc_per_node=2 -m tadm train"),
    (1, 2, 2, None),  # every rank gets the Ctrl-C; only rank 0 speaks
    (0, 16, 8, "torchrun --nnodes=2 --nproc_per_node=8 -m tadm train"),
])
def test_ctrl_c_under_torchrun_is_one_line_with_the_torchrun_command(
    rank: int, world: int, per_node: int, launch: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import tadm.cli.train as train_cli

    def interrupted(cfg: ExperimentConfig, resume: bool = False) -> None:
        raise KeyboardInterrupt  # what a rank gets when Ctrl-C reaches torchrun's process group

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "training_state.pt").write_bytes(b"saved")
    monkeypatch.setattr(train_cli, "train", interrupted)
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    code, _, err = _run_cli(capsys, "train", "tadm-tiny", f"train.out_dir={tmp_path / 'run'}")
    assert code == 130
    if launch is None:
        assert err == ""
        return
    expected = (f"tadm train: interrupted; the last training state is {tmp_path / 'run' / 'training_state.pt'}; "
                f"resume with: {launch} tadm-tiny train.out_dir={tmp_path / 'run'} --resume")
    if world > per_node:
        expected += " (on every node, with the run's rendezvous options)"
    assert _one_line(err) == expected


# ------------------------------------------------------------------------------- bad state files
def test_a_truncated_training_state_is_a_one_line_error(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_config(tmp_path / "run", tokenizer_dir, cache_dir, "train.max_steps=1")
    train(cfg)
    state = tmp_path / "run" / "training_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    with pytest.raises(CorruptStateError, match="is truncated or corrupt"):
        load_training_state(state)
    save_config(cfg, tmp_path / "run.yaml")
    code, _, err = _run_cli(capsys, "train", str(tmp_path / "run.yaml"), "--resume")
    assert code == 2 and f"training state {state} is truncated or corrupt" in _one_line(err)


def test_resume_refuses_a_lower_max_steps_and_overwrite(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A run resumed below its step count would rewrite final/ with a config claiming fewer steps."""
    cfg = run_config(tmp_path / "run", tokenizer_dir, cache_dir, "train.max_steps=2")
    train(cfg)
    config_file = tmp_path / "run" / "final" / "train_config.yaml"
    saved = config_file.read_text()
    save_config(cfg, tmp_path / "run.yaml")
    code, _, err = _run_cli(capsys, "train", str(tmp_path / "run.yaml"), "--resume", "train.max_steps=1")
    assert code == 2 and "has done 2 steps, more than train.max_steps=1" in _one_line(err)
    code, _, err = _run_cli(capsys, "train", str(tmp_path / "run.yaml"), "--resume", "train.overwrite=true")
    assert code == 2 and "give one of them" in _one_line(err)
    assert config_file.read_text() == saved and (tmp_path / "run" / "training_state.pt").is_file()


def test_resume_after_the_corpus_changed_says_so(tmp_path: Path, tokenizer_dir: Path, cache_dir: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(FIXTURE.read_bytes())
    cfg = run_config(tmp_path / "run", tokenizer_dir, cache_dir, f"data.source={corpus}", "train.max_steps=1")
    train(cfg)
    blocks = load_training_state(tmp_path / "run" / "training_state.pt")["sampler"]["num_blocks"]
    corpus.write_text(corpus.read_text() + "".join(FIXTURE.read_text().splitlines(keepends=True)[:3]))
    save_config(cfg, tmp_path / "run.yaml")
    code, _, err = _run_cli(capsys, "train", str(tmp_path / "run.yaml"), "--resume", "train.max_steps=2")
    line = _one_line(err)
    assert code == 2 and f"cannot resume from {tmp_path / 'run' / 'training_state.pt'}: the corpus '{corpus}' changed " \
        f"since the run was saved ({blocks:,} -> " in line, line
    assert "training blocks of 32 tokens); resume on the corpus as it was, or start a new run" in line


# ------------------------------------------------------------------------------------- tokenizers
def test_tokenizer_train_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tok"
    args = ("tokenizer", "train", "--source", str(FIXTURE), "--vocab-size", "300", "--out", str(out))
    assert _run_cli(capsys, *args)[0] == 0
    record = json.loads((out / PROVENANCE_FILENAME).read_text())
    assert record["vocab_size"] == 300 and record["source"] == str(FIXTURE.resolve())
    assert record["num_documents"] == 30 and len(record["text_sha256"]) == 64
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = _run_cli(capsys, *args[:-3], "290", "--out", str(out))
    assert code == 2 and f"--out '{out}' already holds a tokenizer (trained on '{FIXTURE.resolve()}', vocab size " \
                          "300); pass --overwrite to replace it" in _one_line(err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # byte for byte
    assert _run_cli(capsys, *args[:-3], "290", "--out", str(out), "--overwrite")[0] == 0
    assert json.loads((out / PROVENANCE_FILENAME).read_text())["vocab_size"] == 290
    (tmp_path / "file").write_text("x")
    code, _, err = _run_cli(capsys, *args[:-1], str(tmp_path / "file"))
    assert code == 2 and "is an existing file; give a directory" in _one_line(err)


def _bpe_run(out_dir: Path, cache_dir: Path, source: Path, vocab: int, *extra: str) -> ExperimentConfig:
    from tests.training.test_trainer import tiny

    return tiny(out_dir, "bpe", cache_dir, f"data.source={source}", f"data.tokenizer_vocab_size={vocab}",
                "train.max_steps=1", *extra)


def _keep_only_the_tokenizer(out: Path) -> None:
    for path in out.iterdir():
        if path.name != "tokenizer":
            shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.slow
def test_a_run_reuses_only_a_tokenizer_trained_on_its_corpus(tmp_path: Path, cache_dir: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "a.jsonl"
    corpus.write_bytes(FIXTURE.read_bytes())
    out = tmp_path / "run"
    first = train(_bpe_run(out, cache_dir, corpus, 300))
    # the same text under another name (a moved corpus) is the same corpus
    moved = tmp_path / "moved.jsonl"
    corpus.rename(moved)
    _keep_only_the_tokenizer(out)  # as if the run had died before its first save
    tok_files = {p.name: p.read_bytes() for p in (out / "tokenizer").iterdir() if p.name != PROVENANCE_FILENAME}
    again = train(_bpe_run(out, cache_dir, moved, 300))
    assert again.losses == first.losses
    assert json.loads((out / "tokenizer" / PROVENANCE_FILENAME).read_text())["source"] == str(moved.resolve())
    # a resumed run whose corpus changed under it stops, and keeps its tokenizer
    text = moved.read_text()
    moved.write_text(text + json.dumps({"text": "one more document"}) + "\n")
    with pytest.raises(TokenizerMismatchError, match=f"on an earlier version of '{moved.resolve()}', not on the "
                                                     r"text of .* now; the run was trained with this tokenizer: resume "
                                                     r"on the corpus it was trained on, or start a new run "
                                                     r"\(train.overwrite=true, or another train.out_dir\)$") as err:
        train(_bpe_run(out, cache_dir, moved, 300, "train.max_steps=2"), resume=True)
    assert "data.tokenizer=" not in str(err.value)  # a resume refuses that change of config
    assert {p.name: p.read_bytes() for p in (out / "tokenizer").iterdir() if p.name != PROVENANCE_FILENAME} \
        == tok_files
    moved.write_text(text)
    # a tokenizer without a record (saved by an older tadm) is kept by a resumed run
    (out / "tokenizer" / PROVENANCE_FILENAME).unlink()
    resumed = train(_bpe_run(out, cache_dir, moved, 300, "train.max_steps=2"), resume=True)
    assert resumed.step == 2 and torch.isfinite(torch.tensor(resumed.losses)).all()
    # in an out_dir that holds no run, a tokenizer that does not fit (another vocabulary, another corpus,
    # no record) was left by a run that saved nothing: a fresh run trains a new one and says so
    capsys.readouterr()
    other = tmp_path / "b.jsonl"
    other.write_text("\n".join(FIXTURE.read_text().splitlines()[:20]) + "\n")
    for source, vocab, said in ((moved, 300, "with no record of what it was trained on"),
                                (moved, 320, "was trained with vocab_size 300 (now 320)"),
                                (other, 320, f"was trained on '{moved.resolve()}', not on the text of")):
        _keep_only_the_tokenizer(out)
        train(_bpe_run(out, cache_dir, source, vocab))
        assert said in capsys.readouterr().out
        record = json.loads((out / "tokenizer" / PROVENANCE_FILENAME).read_text())
        assert (record["source"], record["vocab_size"]) == (str(source.resolve()), vocab)
