"""Provenance that cannot drift: every unit records its commit and whether the tree was clean, a table from
a dirty tree needs an explicit flag, and the tables say so."""

import json
import subprocess

import pytest

import tadm.records as records
from tadm.eval.likelihood import LikelihoodResult
from tadm.eval.mauve import MauveResult
from tadm.records import DirtyTreeError, UnitStore, check_publishable, provenance_note
from tadm.study.config import load_study_config
from tadm.study.report import _setup_lines
from tadm.tasks.task_tables import provenance_lines

DIRTY = {"commit": "0123456789abcdef", "dirty": True}
CLEAN = {"commit": "fedcba9876543210", "dirty": False}


@pytest.fixture
def tree(monkeypatch):
    """Set the state git reports for the source tree."""
    monkeypatch.delenv(records.ALLOW_DIRTY_ENV, raising=False)

    def set_state(state):
        monkeypatch.setattr(records, "git_commit", lambda where=None: dict(state))
    return set_state


def test_a_package_installed_inside_another_repository_has_no_commit(tmp_path):
    """A virtualenv inside a user's own git project: its changes are not tadm's, its commit is not tadm's."""
    project = tmp_path / "project"
    installed = project / ".venv" / "lib" / "site-packages" / "tadm"
    installed.mkdir(parents=True)
    (installed / "records.py").write_text("# installed copy\n")
    (project / ".gitignore").write_text(".venv/\n")
    (project / "analysis.py").write_text("x = 1\n")

    def git(*args):
        subprocess.run(["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)
    git("init", "-q")
    git("add", ".gitignore", "analysis.py")
    git("commit", "-q", "-m", "own work")
    (project / "analysis.py").write_text("x = 2\n")  # the user's uncommitted change
    assert records.git_commit(installed) == {"commit": None, "dirty": None}
    # the project's own tracked folder is a checkout: its commit and its changes
    own = records.git_commit(project)
    assert len(own["commit"]) == 40 and own["dirty"] is True


def test_a_unit_records_its_commit_and_whether_the_tree_was_clean(tree, tmp_path):
    store = UnitStore(tmp_path)
    tree(DIRTY)
    store.save("units/a.json", {"K": 2}, {"accuracy": 0.5})
    tree(CLEAN)
    store.save("units/b.json", {"K": 3}, {"accuracy": 0.4})
    a = json.loads((tmp_path / "units" / "a.json").read_text())
    b = json.loads((tmp_path / "units" / "b.json").read_text())
    assert a["provenance"] == DIRTY and b["provenance"] == CLEAN
    note = provenance_note([a["provenance"], b["provenance"]])
    assert note is not None and "local changes" in note and "0123456789" in note
    assert provenance_note([b["provenance"]]) is None


def test_publishing_from_a_dirty_tree_needs_the_flag(tree, monkeypatch):
    tree(DIRTY)
    with pytest.raises(DirtyTreeError, match="uncommitted changes.*--allow-dirty"):
        check_publishable()
    assert check_publishable(allow_dirty=True) == DIRTY
    monkeypatch.setenv(records.ALLOW_DIRTY_ENV, "1")
    assert check_publishable() == DIRTY
    tree(CLEAN)
    monkeypatch.delenv(records.ALLOW_DIRTY_ENV)
    assert check_publishable() == CLEAN


def test_the_task_table_and_the_study_report_say_when_the_tree_was_dirty():
    lines = provenance_lines({"command": "x", "machine": {}, **DIRTY, "wall_seconds": 1.0}, [])
    assert any("`0123456789` with local changes" in line for line in lines)
    lines = provenance_lines({"command": "x", "machine": {}, **CLEAN, "wall_seconds": 1.0}, [])
    assert not any("local changes" in line for line in lines)
    cfg = load_study_config("study-tiny")
    report = "\n".join(_setup_lines(cfg, [{"command": "tadm study study-tiny", **CLEAN},
                                          {"command": "tadm study study-tiny", **DIRTY}]))
    assert "Made from a source tree with local changes" in report and "0123456789" in report
    assert "local changes" not in "\n".join(_setup_lines(cfg, [{"command": "tadm study study-tiny", **CLEAN}]))


def test_a_dataclass_record_lists_fields_in_order_then_properties_without_omitted_ones():
    mauve = MauveResult(mauve=0.5, frontier_integral=0.1, num_buckets=3, num_reference=7, num_samples=9)
    assert list(records.dataclass_record(mauve).items()) == [
        ("mauve", 0.5), ("frontier_integral", 0.1), ("num_buckets", 3), ("num_reference", 7), ("num_samples", 9)]
    result = LikelihoodResult(kind="nelbo", nll=1.0, num_tokens=4, num_sequences=2, num_t_samples=1,
                              discrete_steps=None, seed=0)
    record = records.dataclass_record(result, "ppl", omit=("seed",))
    assert "seed" not in record and list(record)[-1] == "ppl" and record["ppl"] == pytest.approx(2.718281828)


def test_a_markdown_table_left_aligns_the_first_column_and_centres_the_rest():
    table = records.markdown_table(["model", "K", "tok/s"], [["tadm", 2, 63.5], ["mdlm", 1, None]])
    assert table.splitlines() == ["| model | K | tok/s |", "|---|:---:|:---:|", "| tadm | 2 | 63.5 |",
                                  "| mdlm | 1 | None |"]
