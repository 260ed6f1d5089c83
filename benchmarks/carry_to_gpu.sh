#!/usr/bin/env bash
# Packs what the lent GPU machine lacks beyond ../shared/gpu's bundles (.gpu) into parts that fit
# one call each (a call carries at most 64 MiB with the working tree): the real tiny.en and base
# weights (for tests/engine/test_gpu_real_weights.py) and the
# wheels the app's ingress and the realtime benchmark need there (PyAV below 19, onnxruntime,
# silero-vad, the openai client and its httpx2 stack).
#
#   bash benchmarks/carry_to_gpu.sh            # here, once: writes .gpu-w/p00 .. p0N (git-ignored)
#   WEIGHTS=0 WHEELS="av>=12,<19" bash benchmarks/carry_to_gpu.sh   # the app on random weights needs only
#                                               # PyAV: one part, carried with the run itself
#
# Then on the GPU machine, calls back to back (it goes back ~30 s after a call ends, and /tmp with it):
#   1. carry [".gpu"]:   source .gpu/install.sh; cp benchmarks/gpu_env.sh /tmp/
#                        mkdir -p /tmp/mini /tmp/parts /tmp/w
#                        for f in .gpu/mini/*.xz; do xz -dc $f > /tmp/mini/$(basename ${f%.xz}); done
#   2. carry [".gpu-w/p00"], then p01, ...:   cp .gpu-w/p0K/* /tmp/parts/
#   3. after the last part:   cat /tmp/parts/part.* | tar -x -C /tmp/w
#        python3 -m pip install -q --no-index --no-deps --target /tmp/site --upgrade /tmp/w/whl/*.whl
#        source /tmp/gpu_env.sh   # the weights are then /tmp/w/tiny and /tmp/w/base
# (benchmarks/gpu_env.sh: PYTHONPATH, UCX and the WHISPER_DISAGG_* variables the tests read.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PART_BYTES=${PART_BYTES:-58800000}  # + the working tree (~5 MB) stays under 64 MiB
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/tiny" "$stage/base" "$stage/whl"
if [[ "${WEIGHTS:-1}" == 1 ]]; then
  cp "$($PY -c 'from engine.model.weights import resolve_model_folder as r; print(r("tiny.en"))')"/* "$stage/tiny/"
  cp "$($PY -c 'from engine.model.weights import resolve_model_folder as r; print(r("base"))')"/* "$stage/base/"
fi
download() {
  $PY -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$stage/whl" "$@"
}
# shellcheck disable=SC2086
download ${WHEELS:-"av>=12,<19" onnxruntime silero-vad openai jiter distro tqdm sniffio anyio httpx2 httpcore2 truststore idna h11}
tar -cf "$stage/all.tar" -C "$stage" tiny base whl
rm -rf .gpu-w && mkdir -p .gpu-w
split -b "$PART_BYTES" -d "$stage/all.tar" .gpu-w/part.
for part in .gpu-w/part.*; do
  folder=.gpu-w/p${part##*.}
  mkdir -p "$folder" && mv "$part" "$folder/"
done
du -sh .gpu-w/*
