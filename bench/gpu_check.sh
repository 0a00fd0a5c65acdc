#!/usr/bin/env bash
# GPU check of the cuda backend on a machine with an NVIDIA GPU, in under 5 minutes:
#
#   bench/gpu_check.sh [OUT]          # OUT defaults to bench/out/gpu
#
# 1. installs this checkout's distributions the cuda backend needs into the current Python
#    (editable, --no-deps --no-index --no-build-isolation: offline, nothing downloaded; torch,
#    triton and the core's other dependencies must already be importable, e.g. from
#    wheels installed with --target into a folder on PYTHONPATH);
# 2. runs the conformance kit: zllm conformance --backend cuda --report OUT/conformance
#    (every registered kernel against the f32 references — the fused MoE kernel moe[f32/f16/
#    bf16/q8_0] and MLA decode mla_attention[paged] included — then small models end to end);
# 3. runs bench/gpu_decode.py: decode tokens/s of a random ~1B Llama in bf16 at batch 1 and
#    32, and the share of the measured copy bandwidth each decode step reaches.
#
# OUT receives environment.txt, install.log, conformance.{txt,json,md},
# gpu_decode.{txt,json,md} and summary.md. Exit status: 0 when every stage passed, else 1
# (summary.md says which stage failed and why; each stage's log holds the details).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(mkdir -p "${1:-$REPO/bench/out/gpu}" && cd "${1:-$REPO/bench/out/gpu}" && pwd)"
PYTHON="${PYTHON:-python3}"
DISTS=(zllm-core zllm-models/llama zllm-models/deepseek zllm-kernels-triton zllm-kernels-torch zllm-backend-cuda)
cd "$REPO" || exit 1

status=0
summary=("# zllm GPU check" "" "| stage | result | seconds |" "| --- | --- | --- |")

stage() {  # stage NAME TIMEOUT_S LOG COMMAND...: run one stage, record its result
    local name=$1 limit=$2 log=$3
    shift 3
    local start=$SECONDS rc
    echo "== $name (at most ${limit}s) -> $log"
    timeout "$limit" "$@" >"$log" 2>&1
    rc=$?
    local result="passed"
    if [ $rc -eq 124 ]; then result="timed out after ${limit}s"; elif [ $rc -ne 0 ]; then result="failed (exit $rc)"; fi
    [ $rc -eq 0 ] || status=1
    summary+=("| $name | $result | $((SECONDS - start)) |")
    tail -n 3 "$log"
    return $rc
}

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
    "$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
    "$PYTHON" -c 'import triton; print("triton", triton.__version__)' 2>&1
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

if stage install 120 "$OUT/install.log" \
        "$PYTHON" -m pip install --no-deps --no-index --no-build-isolation $(printf -- '-e %s ' "${DISTS[@]}"); then
    stage conformance 170 "$OUT/conformance.txt" \
        "$PYTHON" -m zllm.cli.main conformance --backend cuda --report "$OUT/conformance"
    stage decode-benchmark 120 "$OUT/gpu_decode.txt" \
        "$PYTHON" bench/gpu_decode.py --backend cuda --device cuda:0 --out "$OUT"
fi

printf '%s\n' "${summary[@]}" "" "Logs and reports: \`$OUT\`." >"$OUT/summary.md"
[ -f "$OUT/gpu_decode.md" ] && { echo; cat "$OUT/gpu_decode.md"; } >>"$OUT/summary.md"
cat "$OUT/summary.md"
exit $status
