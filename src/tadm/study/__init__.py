"""Staleness studies: train model kinds at equal size and budget, evaluate stale-anchor quality, report.

``tadm study CONFIG`` (:mod:`tadm.cli.study`) runs :func:`run_study` on a :class:`StudyConfig`
loaded by :func:`load_study_config` (a YAML file or a shipped preset such as ``study-brown-cpu``).
"""

from tadm.study.config import (MODEL_KINDS, StudyConfig, StudyModel, list_study_presets, load_study_config,
                               model_experiment_config)
from tadm.study.runner import StudyLayout, StudyOutput, run_study

__all__ = ["MODEL_KINDS", "StudyConfig", "StudyLayout", "StudyModel", "StudyOutput", "list_study_presets",
           "load_study_config", "model_experiment_config", "run_study"]
