# Sourced on the GPU machine, from the repo root, in the calls after the one that ran
# .gpu/install.sh (copy it to /tmp there; see benchmarks/carry_to_gpu.sh).
export PYTHONPATH=/tmp/site:$PWD
export PATH=/tmp/site/bin:$PATH
export UCX_MODULE_DIR=/tmp/site/nixl_cu13.libs/ucx
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
export WHISPER_DISAGG_EN_TOKENIZER=/tmp/mini/tokenizer.json WHISPER_DISAGG_TOKENIZER=/tmp/mini/tokenizer-multilingual.json
export WHISPER_DISAGG_GPU_TINY_EN=/tmp/w/tiny WHISPER_DISAGG_GPU_BASE=/tmp/w/base
export PYTHONUNBUFFERED=1
