#!/usr/bin/env bash
# Score any OpenAI-compatible server (vLLM, a hosted API, `posttrain serve` once it lands) on the same
# held-out tasks posttrain trains on: strict accuracy with bootstrap intervals, mean shaped reward apart.
# Code domains run the server's answers in posttrain's sandbox (bubblewrap). Options after MODEL are
# passed on to `posttrain eval` and win over the defaults here, e.g. --n 8 or --temperature 1 --samples 8 --pass-at 1,8:
#   examples/score_openai_endpoint.sh http://127.0.0.1:8000/v1 Qwen/Qwen2.5-0.5B-Instruct
set -euo pipefail
API_BASE=${1:?usage: $0 API_BASE MODEL [posttrain eval options]}
MODEL=${2:?usage: $0 API_BASE MODEL [posttrain eval options]}
shift 2
HERE=$(cd "$(dirname "$0")" && pwd)
POSTTRAIN=${POSTTRAIN:-$HERE/../.venv/bin/posttrain}
[ -x "$POSTTRAIN" ] || POSTTRAIN=posttrain
"$POSTTRAIN" eval --api-base "$API_BASE" --model "$MODEL" --suite math,code.unit_tests,tools.apis --n 32 --json "$@"
