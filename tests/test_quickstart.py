import json
from pathlib import Path

import pytest

from tadm.cli import main
from tadm.cli.quickstart import unigram_entropy, word_validity

FIXTURE = Path(__file__).parent / "fixtures" / "brown_slice.jsonl"


def test_quality_proxies_by_hand():
    assert word_validity(["the cat sat", "zzq the"], {"the", "cat"}) == 3 / 5
    assert abs(unigram_entropy([[1, 1, 2, 2]]) - 0.6931471805599453) < 1e-12
    assert unigram_entropy([[7, 7, 7]]) == 0.0


@pytest.mark.slow
def test_quickstart_end_to_end_on_the_fixture(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the packed-data cache goes under the working directory
    out = tmp_path / "qs"
    code = main(["quickstart", "--out", str(out), "--source", str(FIXTURE), "--train-steps", "3", "--samples", "2",
                 "--steps", "8", "--refresh", "1", "4"])
    assert code == 0
    summary = json.loads((out / "quickstart.json").read_text())
    rows = {(r["model"], r["K"]): r for r in summary["rows"]}
    assert set(rows) == {("untrained", 1), ("trained", 1), ("trained", 4)}
    # 4 anchor + 2 denoiser layers: T = 8 -> K = 1: 8 * 6 = 48 calls; K = 4: 8 * 2 + 2 * 4 = 24
    assert rows[("trained", 1)]["layer_calls"] == 48 and rows[("trained", 4)]["layer_calls"] == 24
    assert (out / "final" / "model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert "| trained   |  4 |" in printed and "trained 3 steps in" in printed
    # run again: the finished run is sampled, not trained, and the line says so
    assert main(["quickstart", "--out", str(out), "--source", str(FIXTURE), "--train-steps", "3", "--samples", "2",
                 "--steps", "8", "--refresh", "1"]) == 0
    assert "trained 0 more steps (3 in all) in" in capsys.readouterr().out
    # errors name this command's flags, not the preset's keys
    assert main(["quickstart", "--out", str(out), "--train-steps", "3"]) == 2  # another --source than the run's
    err = capsys.readouterr().err.strip()
    assert "(--source: saved" in err and "train.out_dir" not in err and "data.source" not in err
    assert err.endswith("a run in --out continues with its own settings: choose another --out to change them")
