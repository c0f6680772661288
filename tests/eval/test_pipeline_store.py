"""Where the pipeline's units live, with the store's root given as a relative path (as `out_dir` usually is)."""

from __future__ import annotations

from pathlib import Path

from tadm.eval.pipeline import Cell, PipelineStore, SamplerSection
from tadm.sampling.refresh import parse_refresh


def test_units_of_a_relative_root_land_under_it_and_are_found_again(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = PipelineStore(Path("runs") / "study")
    cell = Cell(label="tadm", model_path="runs/study/models/tadm-s0/final", steps=32, policy=parse_refresh(8), seed=0)
    spec = {"model": cell.model_path, "steps": 32, "refresh": 8}
    for relative, payload in ((store.sample_path(cell), {"token_ids": [[1, 2]]}),
                              (store.score_path("ar", cell), {"gen_ppl": 12.5}),
                              (store.score_path("ar", None), {"gen_ppl": 9.0}),
                              (store.throughput_path, {"rows": []})):
        assert not store.done(relative, spec)
        store.save(relative, spec, payload)
        assert store.done(relative, spec) and store.load(relative)["spec"] == spec
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.json"))
    assert written == ["runs/study/samples/tadm-s0/T32-K8.json", "runs/study/scores/ar/data.json",
                       "runs/study/scores/ar/tadm-s0-T32-K8.json", "runs/study/throughput.json"]


def test_a_sample_unit_records_a_noise_schedule_other_than_the_default():
    """Samples made under the cosine schedule are not reused for log-linear ones (or the other way round); units
    made before the schedule was recorded (all log-linear) keep their spec."""
    default = SamplerSection().spec()
    assert "schedule" not in default and SamplerSection(schedule="loglinear").spec() == default
    assert SamplerSection(schedule="cosine").spec() == default | {"schedule": "cosine"}


def test_a_study_store_records_paths_inside_it_relative_and_a_sweep_store_as_given(tmp_path):
    """A study's units name its models relative to its root (so a moved study keeps them) and still accept the
    path as named; a sweep's units record the user's model paths exactly as given."""
    study = PipelineStore(tmp_path / "study", relative_paths=True)
    inside, outside = str(tmp_path / "study" / "models" / "tadm-s0" / "final"), str(tmp_path / "elsewhere" / "m")
    assert study.recorded(inside) == "models/tadm-s0/final"
    assert study.recorded(outside) == outside and study.recorded("smollm2-135m") == "smollm2-135m"
    assert [form(inside) for form in study.forms] == ["models/tadm-s0/final", inside]
    assert PipelineStore(Path("runs") / "study", relative_paths=True).recorded("runs/study/models/a/final") == \
        "models/a/final"
    sweep = PipelineStore(tmp_path / "study")
    assert sweep.recorded(inside) == inside and [form(inside) for form in sweep.forms] == [inside]
    cell = Cell(label="tadm", model_path=inside, steps=4, policy=parse_refresh(1))
    store_spec = {"model": inside, "steps": 4}
    sweep.save("samples/a.json", store_spec, {})
    assert study.done_as_any("samples/a.json", [{"model": form(cell.model_path), "steps": 4} for form in study.forms])
    assert not study.done_as_any("samples/a.json", [{"model": "models/other/final", "steps": 4}])
