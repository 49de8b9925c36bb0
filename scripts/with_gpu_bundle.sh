#!/usr/bin/env bash
# Runs a command on an offline GPU machine with gpu_bundle/ installed beside its own torch:
#   bash scripts/with_gpu_bundle.sh python3 -m repro.reproduce_gpu --steps 1,2
# The bundle goes once into build/gpu_site (git-ignored; reinstalled when requirements.txt
# changes) with --no-index --no-deps, then PYTHONPATH points there. When $OUT is set (a folder
# that is carried back, as on a lent device machine), results/gpu/ is copied into $OUT after the
# command, whatever its exit status.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SITE=$REPO/build/gpu_site
PY=${PY:-python3}
cd "$REPO"
if [ -f gpu_bundle/requirements.txt ] && ! cmp -s gpu_bundle/requirements.txt "$SITE/.installed" 2>/dev/null; then
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --find-links gpu_bundle --target "$SITE" -r gpu_bundle/requirements.txt \
    && cp gpu_bundle/requirements.txt "$SITE/.installed" || { echo "with_gpu_bundle: installing the bundle failed" >&2; exit 2; }
fi
[ -d "$SITE" ] || echo "with_gpu_bundle: no gpu_bundle/ here (make gpu-bundle on a machine with PyPI); running without it" >&2
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"  # bin: ninja, for cpp_extension
"$@"
rc=$?
if [ -n "${OUT:-}" ] && [ -d results/gpu ]; then
  mkdir -p "$OUT/results" && cp -r results/gpu "$OUT/results/"
fi
exit $rc
