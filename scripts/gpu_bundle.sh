#!/usr/bin/env bash
# make gpu-bundle: everything a GPU machine without internet needs beyond its own image, in
# gpu_bundle/ (git-ignored, at most 40 MB): wheels for Python 3.12 / manylinux x86_64 of
# scripts/gpu_bundle.txt, antlr4-python3-runtime 4.9.3 (PyPI has only its sdist: built here
# into a wheel), the pytorch-fast-transformers 0.4.0 sdist (the benchmark builds one file of
# it), and requirements.txt pinning exactly what is there. Needs PyPI; run with a Python that
# has torch (fast-transformers' setup.py imports it to say its metadata).
# On the GPU machine (never touches its torch):
#   python3 -m pip install --no-index --no-deps --find-links gpu_bundle --target /tmp/site -r gpu_bundle/requirements.txt
#   export PYTHONPATH=/tmp/site
set -euo pipefail
PY=${PY:-python3}
# not $OUT: with_gpu_bundle.sh packs results into $OUT (the folder a remote node returns), and this script empties its folder
DEST=${GPU_BUNDLE_DIR:-gpu_bundle}
LIMIT_MB=60
HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf "$DEST" && mkdir -p "$DEST"
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT

grep -v '^\s*#' "$HERE/gpu_bundle.txt" | grep -v '^\s*$' > "$tmp/wheels.txt"
"$PY" -m pip download -q --no-deps --only-binary :all: --dest "$DEST" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform any \
    -r "$tmp/wheels.txt"
# antlr4-python3-runtime ships as an sdist only: its pure-Python wheel, built from it
"$PY" -m pip download -q --no-deps --no-binary :all: --dest "$tmp" antlr4-python3-runtime==4.9.3
"$PY" -m pip wheel -q --no-deps --wheel-dir "$DEST" "$tmp"/antlr4-python3-runtime-4.9.3.tar.gz
# the authors' library, as source (its setup.py needs torch to say its metadata)
"$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation --dest "$DEST" pytorch-fast-transformers==0.4.0

# requirements.txt: name==version of every wheel here
{
  echo "# python3 -m pip install --no-index --no-deps --find-links gpu_bundle --target /tmp/site -r gpu_bundle/requirements.txt"
  for w in "$DEST"/*.whl; do
    b=$(basename "$w"); name=${b%%-*}; rest=${b#*-}; echo "${name//_/-}==${rest%%-*}"
  done
} > "$DEST/requirements.txt"

mb=$(du -sm "$DEST" | cut -f1)
ls -la "$DEST"
echo "gpu_bundle: $(ls "$DEST"/*.whl | wc -l) wheels + the fast-transformers sdist, ${mb} MB in $DEST/"
if [ "$mb" -gt "$LIMIT_MB" ]; then
  echo "gpu_bundle: ${mb} MB is over the ${LIMIT_MB} MB limit (the GPU machine's transfer limit is 64 MiB with the tree)" >&2
  exit 1
fi
