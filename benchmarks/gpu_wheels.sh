#!/usr/bin/env bash
# Wheels of tadm's requirements that the GPU machine's image lacks, built for its Python (3.12, x86-64 Linux),
# into DIR (default .whl, git-ignored; a relative DIR is taken from the repository root). That machine has no
# network: carry DIR to it, then there
#   python3 -m pip install -q --no-index --no-deps --target .site DIR/*.whl && export PYTHONPATH=$PWD/.site:$PWD/src
# and run python benchmarks/gpu_campaign.py (which starts tadm as python -m tadm, so PYTHONPATH is all it needs).
# The image has torch 2.11, transformers 5.17, accelerate, safetensors, huggingface_hub, tokenizers, numpy, scipy,
# pyyaml, tqdm, matplotlib, scikit-learn and tensorboard. It lacks omegaconf (a core requirement; it carries its own
# antlr4 runtime) and mauve-text with faiss-cpu (MAUVE in stage d's study). Versions: those of constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
specs=()
for name in omegaconf mauve-text faiss-cpu; do
  if ! spec=$(grep -i "^$name==" constraints.txt); then
    echo "gpu_wheels: $name is not pinned in constraints.txt" >&2
    exit 2
  fi
  specs+=("$spec")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${specs[@]}"
ls -l "$dest"
