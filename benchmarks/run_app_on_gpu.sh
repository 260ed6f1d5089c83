#!/usr/bin/env bash
# Issue 7, part (d): the whole Ray Serve app on one GPU (configs/large-v3-one-gpu.yaml: encoder and
# decoder replicas sharing it, K/V over NIXL) under benchmarks/bench_load.py, with random weights
# of the large-v3 shape saved by transformers (the real checkpoint cannot be carried to the lent GPU).
#
#   TOKENIZER=<multilingual tokenizer.json> [CLIENTS=48 DURATION=60 WARMUP=10 STARTUP_S=300] \
#     [BENCH_ARGS="--fixed-output-tokens 224 --no-fallback"] bash benchmarks/run_app_on_gpu.sh
#
# Prints the time from `serve run` to /ready (a warm-up window through encoder, NIXL and decoder)
# and the first request's latency after it, then bench_load's table and the decoders' K/V pull
# times from /metrics.
#
# On the lent GPU machine, after `source .gpu/install.sh` (../shared/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${TOKENIZER:?set TOKENIZER to a multilingual Whisper tokenizer.json}"
CLIENTS=${CLIENTS:-48}
DURATION=${DURATION:-60}
WARMUP=${WARMUP:-10}
STARTUP_S=${STARTUP_S:-300}
WORK=${WORK:-/tmp/whisper-app}
mkdir -p "$WORK"

python3 - "$WORK" "$TOKENIZER" <<'EOF'
import shutil, sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, ".")
from benchmarks.gpu_models import random_hf_whisper

work, tokenizer = Path(sys.argv[1]), sys.argv[2]
random_hf_whisper("large-v3", "cpu", torch.bfloat16).save_pretrained(work / "large-v3")
shutil.copy(tokenizer, work / "large-v3" / "tokenizer.json")
config = yaml.safe_load(Path("configs/large-v3-one-gpu.yaml").read_text())
config["applications"][0]["args"]["engine"]["model"] = str(work / "large-v3")
(work / "app.yaml").write_text(yaml.safe_dump(config))
EOF

# Without the dashboard: the GPU machine's trimmed ray has no dashboard build (../shared/gpu/README.md).
python3 -m ray.scripts.scripts start --head --include-dashboard=false --num-gpus=1 > "$WORK/ray.log" 2>&1
started=$(date +%s.%N)
python3 -m ray.serve.scripts run --address=auto "$WORK/app.yaml" > "$WORK/serve.log" 2>&1 &
serve_pid=$!
trap 'kill $serve_pid 2>/dev/null || true; python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true' EXIT
ready() { python3 -c "import urllib.request; urllib.request.urlopen('http://localhost:8000/ready', timeout=5)" 2>/dev/null; }
until ready; do
  if (( $(date +%s) - ${started%.*} > STARTUP_S )); then
    echo "the app was not ready within ${STARTUP_S} s"; tail -50 "$WORK/serve.log"; exit 1
  fi
  sleep 0.5
done
echo "ready after $(python3 -c "import time; print(round(time.time() - $started, 1))") s from serve run"
python3 - <<'EOF2'
import time, httpx
clip = "tests/data/speech/jfk.flac"
started = time.perf_counter()
response = httpx.post("http://localhost:8000/v1/audio/transcriptions", files={"file": open(clip, "rb")},
                      data={"model": "whisper-1", "temperature_fallback": "false"}, timeout=300)
print(f"first request after ready: {response.status_code} in {time.perf_counter() - started:.2f} s")
EOF2
# shellcheck disable=SC2086
python3 benchmarks/bench_load.py --url http://localhost:8000 --clients "$CLIENTS" --duration-s "$DURATION" \
  --warmup-s "$WARMUP" ${BENCH_ARGS:-}
python3 -c "import urllib.request; print(urllib.request.urlopen('http://localhost:8000/metrics').read().decode())" \
  | grep -E '^whisper_decoder_(kv_load|tokens|kv_loads)'
grep -E "prepared in|ready:" "$WORK/serve.log" /tmp/ray/session_latest/logs/serve/*.log 2>/dev/null | tail -5 || true
