#!/usr/bin/env bash
# Runs a command on an offline GPU machine with gpu_bundle/ installed beside its own torch:
#   REPRO_GIT_SHA=<commit> bash scripts/with_gpu_bundle.sh python3 -m repro.reproduce_gpu --steps 1 --budget-s 500
# The bundle goes once into build/gpu_site (git-ignored; reinstalled when gpu_bundle/requirements.txt
# changes) with --no-index --no-deps, then PYTHONPATH points there. gpu_bundle/ is git-ignored:
# it reaches a remote node only when copied there beside the tree. Rows record REPRO_GIT_SHA as
# their commit (repro.common.results.git_sha), before any .git there: one that travels may be older.
# When $OUT is set (a folder a remote node returns, which may take only a few files), the
# command's whole output goes to $OUT/command.log, and afterwards, whatever its exit status,
# everything under results/gpu/ and outputs/gpu-smoke/results/ is packed into $OUT as one
# archive (gpu_results.tar.gz, or its .partNN files past 15 MiB; of checkpoints only a cut run's). Unpack it
# into the checkout here with: python -m repro.reproduce_gpu --unpack <the files>
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SITE=$REPO/build/gpu_site
PY=${PY:-python3}
BUNDLE=${GPU_BUNDLE_DIR:-gpu_bundle}  # as scripts/gpu_bundle.sh writes it
cd "$REPO"
if [ -f "$BUNDLE/requirements.txt" ] && ! cmp -s "$BUNDLE/requirements.txt" "$SITE/.installed" 2>/dev/null; then
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --find-links "$BUNDLE" --target "$SITE" -r "$BUNDLE/requirements.txt" \
    && cp "$BUNDLE/requirements.txt" "$SITE/.installed" || { echo "with_gpu_bundle: installing the bundle failed" >&2; exit 2; }
fi
[ -d "$SITE" ] || echo "with_gpu_bundle: no $BUNDLE/ here (make gpu-bundle on a machine with PyPI, and carry it); running without it" >&2
if [ -z "${REPRO_GIT_SHA:-}" ]; then
  echo "with_gpu_bundle: no REPRO_GIT_SHA: rows will record this tree's .git, if any (perhaps not the commit sent)" >&2
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"  # bin: ninja, for cpp_extension
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  "$@" 2>&1 | tee "$OUT/command.log"
  rc=${PIPESTATUS[0]}
  "$PY" -m repro.reproduce_gpu --pack "$OUT" || echo "with_gpu_bundle: packing the results into $OUT failed" >&2
else
  "$@"
  rc=$?
fi
exit $rc
