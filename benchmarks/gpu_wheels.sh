#!/usr/bin/env bash
# Wheels of tadm's requirements that the GPU machine's image lacks, built for its Python (3.12, x86-64 Linux),
# into DIR (default .whl, git-ignored). That machine has no network: carry DIR to it, then there
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:$PWD/src
# and run python benchmarks/gpu_campaign.py (which starts tadm as python -m tadm, so PYTHONPATH is all it needs).
# The image has torch 2.11, transformers 5.17, accelerate, safetensors, huggingface_hub, tokenizers, numpy, scipy,
# pyyaml, tqdm, matplotlib, scikit-learn and tensorboard. It lacks omegaconf (a core requirement, with antlr4, its
# parser's runtime) and mauve-text with faiss-cpu (MAUVE in stage d's study). Versions: those of constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
pin() { grep -i "^$1==" constraints.txt || { echo "gpu_wheels: $1 is not pinned in constraints.txt" >&2; exit 2; }; }
specs=("$(pin omegaconf)" "$(pin antlr4-python3-runtime)" "$(pin mauve-text)" "$(pin faiss-cpu)")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${specs[@]}"
ls -l "$dest"
