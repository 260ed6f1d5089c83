#!/usr/bin/env bash
# Issue 7, part (d): the whole Ray Serve app on one GPU (configs/large-v3-one-gpu.yaml: encoder and
# decoder replicas sharing it, K/V over NIXL) under benchmarks/bench_load.py, with random weights
# of the large-v3 shape saved by transformers (the real checkpoint cannot be carried to the lent GPU).
#
#   TOKENIZER=<multilingual tokenizer.json> [CLIENTS=48 DURATION=60 WARMUP=10 STARTUP_S=300] \
#     bash benchmarks/run_app_on_gpu.sh
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

python3 -m ray.serve.scripts run "$WORK/app.yaml" > "$WORK/serve.log" 2>&1 &
serve_pid=$!
trap 'kill $serve_pid 2>/dev/null || true; python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true' EXIT
started=$(date +%s)
until python3 -c "import urllib.request; urllib.request.urlopen('http://localhost:8000/health', timeout=2)" 2>/dev/null; do
  if (( $(date +%s) - started > STARTUP_S )); then
    echo "the app did not answer /health within ${STARTUP_S} s"; tail -50 "$WORK/serve.log"; exit 1
  fi
  sleep 2
done
echo "app up after $(( $(date +%s) - started )) s"
python3 benchmarks/bench_load.py --url http://localhost:8000 --clients "$CLIENTS" --duration-s "$DURATION" --warmup-s "$WARMUP"
