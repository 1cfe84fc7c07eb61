#!/usr/bin/env bash
# Score any OpenAI-compatible server (vLLM, a hosted API, `posttrain serve` once it lands) on the same
# held-out tasks posttrain trains on, with bootstrap intervals:
#   examples/score_openai_endpoint.sh http://127.0.0.1:8000/v1 Qwen/Qwen2.5-0.5B-Instruct
set -euo pipefail
API_BASE=${1:?usage: $0 API_BASE MODEL}
MODEL=${2:?usage: $0 API_BASE MODEL}
.venv/bin/posttrain eval --api-base "$API_BASE" --model "$MODEL" --suite math,code.unit_tests,tools.apis --n 32 --json
