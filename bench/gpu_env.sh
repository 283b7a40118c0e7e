# Sourced by the GPU scripts (bench/gpu_check.sh, bench/gpu_train.sh) with ROOT set to the repository:
# picks $PYTHON ($PYTHON, else .venv/bin/python when it has torch, else python3), makes $WORK (a temporary
# directory) and puts a `latentlm` package of symlinks (latentlm/* plus models/, service/, training/ as
# latentlm.models, ...) first on PYTHONPATH, so the repository need not be pip-installed on the GPU machine.
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ] && "$ROOT/.venv/bin/python" -c "import torch" 2>/dev/null; then
    PYTHON="$ROOT/.venv/bin/python"
  else
    PYTHON=python3
  fi
fi
WORK="$(mktemp -d /tmp/latentlm-gpu.XXXXXX)"
mkdir -p "$WORK/pkg/latentlm"
for f in "$ROOT"/latentlm/*; do
  case "$(basename "$f")" in __pycache__) ;; *) ln -s "$f" "$WORK/pkg/latentlm/$(basename "$f")" ;; esac
done
for d in models service training; do
  [ -d "$ROOT/$d" ] && ln -sfn "$ROOT/$d" "$WORK/pkg/latentlm/$d"
done
export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"

# private_wheels "IMPORTS": when `python -c IMPORTS` fails, install the wheels in .whl/ (pure-python or cp312
# manylinux x86_64; the GPU machine has no package index) into $WORK/site. Sets SVC_PATH (a PYTHONPATH with
# that dir first, or the current one) and WHEELS (what happened, for the report).
private_wheels() {
  WHEELS="none in .whl/"
  SVC_PATH="$PYTHONPATH"
  if "$PYTHON" -c "$1" 2>/dev/null; then
    WHEELS="not needed ($1 works)"
  elif ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$ROOT"/.whl/*.whl \
        > "$WORK/pip.log" 2>&1; then
      SVC_PATH="$WORK/site:$PYTHONPATH"
      WHEELS="installed $(ls "$ROOT"/.whl/*.whl | wc -l) wheels from .whl/ into a private dir"
    elif "$PYTHON" -c "import glob, sys, zipfile
for w in sorted(glob.glob(sys.argv[1] + '/*.whl')):
    zipfile.ZipFile(w).extractall(sys.argv[2])" "$ROOT/.whl" "$WORK/site" 2>>"$WORK/pip.log"; then
      SVC_PATH="$WORK/site:$PYTHONPATH"  # no pip: a wheel is a zip of importable files
      WHEELS="unzipped $(ls "$ROOT"/.whl/*.whl | wc -l) wheels from .whl/ (pip failed: $(tail -1 "$WORK/pip.log"))"
    else
      WHEELS="could not install .whl/: $(tail -3 "$WORK/pip.log" | tr '\n' ' ')"
    fi
  fi
}
