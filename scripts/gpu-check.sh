#!/usr/bin/env bash
# hybrimoe GPU check: the one script a session that is lent a GPU runs on it.
#
#   scripts/gpu-check.sh prepare        HERE (network, the repo's Python): fill the carry folder .gpucheck/
#   scripts/gpu-check.sh run [DIR]      THERE (no network): build, check, bench; results under $OUT (else DIR)
#
# prepare packs what the GPU machine cannot fetch into .gpucheck/ (git-ignored, ~33 MiB):
#   llama_cpp_python-<v>-trimmed.tar.gz  llama-cpp-python's Python package + CMake files + a trimmed
#                                        vendor/llama.cpp (scripts/pack-llama-source.sh; CUDA sources kept)
#   requirements.txt  the runtime requirements: hybrimoe's (pyproject.toml's dependencies) and llama-cpp-python's,
#                 less llama-cpp-python itself (built there) and numpy (the helper needs it before anything else)
#   wheels/       wheels of those requirements and of theirs, for the GPU machine's CPython 3.12 on x86-64 Linux
#                 (pure-Python ones install on any Python); run installs from them what the machine lacks
#   trace.npz     the first prompts (GPUCHECK_TRACE_TOKENS, default 16384 tokens) of the DeepSeek-V2-Lite
#                 development trace (GPUCHECK_TRACE, else $HYBRIMOE_TRACE, else the default path in prepare)
# Nothing in it is ever committed (upstream source, wheels, trace).
#
# run, one step after another, each under a time budget (a failed or timed-out step is recorded and the next
# ones still run; the whole run ends within GPUCHECK_TIME_S, default 540 s on a GPU):
#   build        the requirements the machine's Python lacks, from the carry's wheels (in both modes; a missing
#                one is named at once); llama-cpp-python with CUDA for sm_90 only (-DGGML_CUDA_FA=OFF and fewer
#                variants, see cuda_cmake_args) and hybrimoe (HYBRIMOE_LLAMA_SRC = the trimmed tree), both wheels
#                built at once, offline, installed into $GPUCHECK_WORK/site; each part timed
#   correctness  tiny models (hybrimoe.tiny.fixture_set; gpt-oss with MXFP4 experts and biases), hybrimoe
#                (moe_cache 25/50/100%, policy hybrimoe)
#                against upstream with the same placement: same greedy tokens, logits NMSE <= 1e-3; then two
#                devices (the GPU plus a ggml-rpc-server --device CUDA0 on loopback, layer split 1:1): the same,
#                with a GPU share on both
#   model        the DeepSeek-V2-Lite-shaped synthetic Q4_K_M model (hybrimoe.tiny.make_synthetic_model: 8
#                blocks, 64 experts, top-6, 2 shared, n_embd 2048, expert width 1408) and the trace cut to it
#   calibrate    hybrimoe calibrate (a full one, when time allows; GPUCHECK_CALIBRATE; else the engine measures
#                a short one on first use, in the first bench)
#   bench-25, bench-50   hybrimoe bench --replay-trace at --moe-cache 25% / 50% against upstream
#                -ot exps=CPU and --n-cpu-moe (pp512, tg128, 2 repetitions)
#   summary      gpu-check.json: device, build times, correctness, bench tables, speed-up at 25%
# Files back under $OUT (7): gpu-check.json, gpu-check.log, build.log, correctness.json, bench-25.json,
# bench-50.json, bench.csv.
#
# On the device tool, after `scripts/gpu-check.sh prepare` here (the working tree + .gpucheck/ must stay
# under 64 MiB; prepare prints both):
#   run(command="scripts/gpu-check.sh run", carry=[".gpucheck"], timeout_s=570)
# If the build finished but the time ran out, call again at once while the machine is warm (30 s), reusing the
# build in /tmp/gpucheck-work:
#   run(command="GPUCHECK_PARTS=model,bench GPUCHECK_TIME_S=200 scripts/gpu-check.sh run",
#       carry=[".gpucheck"], timeout_s=230)
#
# CPU mode (no nvcc or no GPU; GPUCHECK_MODE=cpu forces it): llama-cpp-python is built without CUDA and the
# RPC stand-in (ggml-rpc-server --device CPU) plays the GPU; the model and runs are scaled down. It checks
# the script end to end, not speed. Rehearsal: OUT=/tmp/gpucheck-out scripts/gpu-check.sh run
#
# Knobs (environment): GPUCHECK_MODE auto|cuda|cpu; GPUCHECK_WORK (default /tmp/gpucheck-work);
# GPUCHECK_TIME_S (whole run); GPUCHECK_PARTS (comma list of build,correctness,model,calibrate,bench;
# default all); GPUCHECK_CALIBRATE auto|1|0; GPUCHECK_LAYERS, GPUCHECK_N_EMBD, GPUCHECK_N_FF_EXP,
# GPUCHECK_N_FF_DENSE, GPUCHECK_N_HEAD (bench model); GPUCHECK_N_PROMPT, GPUCHECK_N_GEN, GPUCHECK_REPS,
# GPUCHECK_THREADS, GPUCHECK_CACHES ("25% 50%"), GPUCHECK_POLICIES (hybrimoe), GPUCHECK_UPSTREAM (exps,ncmoe);
# GPUCHECK_CORRECTNESS_MODELS (qwen3moe:Q8_0,deepseek2:Q4_K_M); GPUCHECK_JOBS (build parallelism, default
# all cores); GPUCHECK_CUDA_ARCH (90); GPUCHECK_CUBLAS_DIR (folder with include/cublas_v2.h and
# lib/libcublas.so*, found in the CUDA toolkit or Python's nvidia packages otherwise);
# GPUCHECK_BUDGET_BUILD / _CORRECTNESS / _MODEL / _CALIBRATE / _BENCH (seconds per step).
# prepare: GPUCHECK_SDIST (the llama-cpp-python sdist; fetched with pip otherwise), GPUCHECK_TRACE,
# GPUCHECK_TRACE_TOKENS, GPUCHECK_PYTHON_VERSION (the GPU machine's Python for the wheels, default 3.12).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
carry="$here/.gpucheck"
helper="$here/scripts/gpu_check.py"
PY=${PYTHON:-python3}
self="$here/scripts/gpu-check.sh"

die() { echo "gpu-check: error: $*" >&2; exit 2; }
note() { echo "[gpu-check] $*" >&2; }

pin_field() { "$PY" -c "import json,sys;print(json.load(open(sys.argv[1]))[sys.argv[2]])" \
    "$here/vendor/llama.cpp/pin.json" "$1"; }

# ---------------------------------------------------------------------------------------------------------
# prepare (here)
# ---------------------------------------------------------------------------------------------------------
prepare() {
    local version sha sdist tmp trace
    version=$(pin_field version)
    sha=$(pin_field sha256)
    git -C "$here" check-ignore -q .gpucheck/manifest.txt \
        || die ".gpucheck is not git-ignored: add '/.gpucheck/' to .gitignore first (it holds upstream source)"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' RETURN
    sdist=${GPUCHECK_SDIST:-}
    if [ -z "$sdist" ]; then
        note "fetching llama-cpp-python==$version (sdist) with pip"
        "$PY" -m pip download --no-deps --no-binary llama-cpp-python --no-build-isolation -d "$tmp" \
            "llama-cpp-python==$version" >&2 || die "could not download the llama-cpp-python sdist; set GPUCHECK_SDIST"
        sdist=$(ls "$tmp"/llama_cpp_python-*.tar.gz)
    fi
    [ -f "$sdist" ] || die "GPUCHECK_SDIST=$sdist does not exist"
    echo "$sha  $sdist" | sha256sum -c --quiet - \
        || die "$sdist does not match pin.json's sha256 $sha (llama-cpp-python $version)"

    mkdir -p "$carry/wheels"
    rm -f "$carry"/llama_cpp_python-*-trimmed.tar.gz "$carry/trace.npz" "$carry/manifest.txt" \
        "$carry/requirements.txt"
    "$here/scripts/pack-llama-source.sh" "$tmp/llama.cpp.tar.gz" "$sdist" >&2
    "$PY" "$helper" pack-lcp --sdist "$sdist" --llama-tgz "$tmp/llama.cpp.tar.gz" \
        --out "$carry/llama_cpp_python-$version-trimmed.tar.gz"

    # wheels of every runtime requirement and of theirs, for the GPU machine's Python (its image may lack any of
    # them; run installs only what it lacks); numpy is left out (see requirements.txt above)
    "$PY" "$helper" requirements --pyproject "$here/pyproject.toml" --lcp-source "$sdist" > "$tmp/requirements.txt"
    local pyv=${GPUCHECK_PYTHON_VERSION:-3.12}
    rm -rf "$tmp/wheels"
    if "$PY" -m pip download -q --only-binary=:all: --python-version "$pyv" --implementation cp \
            --abi "cp${pyv/./}" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$tmp/wheels" -r "$tmp/requirements.txt" >&2; then
        rm -f "$tmp"/wheels/numpy-*.whl "$carry"/wheels/*.whl
        mv "$tmp"/wheels/*.whl "$carry/wheels/"
    else
        ls "$carry"/wheels/*.whl >/dev/null 2>&1 \
            || die "could not download the wheels of $(paste -sd' ' "$tmp/requirements.txt")"
        note "pip download failed; keeping the wheels already in $carry/wheels (run names any requirement they lack)"
    fi
    mv "$tmp/requirements.txt" "$carry/requirements.txt"

    trace=${GPUCHECK_TRACE:-${HYBRIMOE_TRACE:-$here/../shared/traces/dsv2lite_dev.npz}}
    [ -f "$trace" ] || die "routing trace $trace not found (set GPUCHECK_TRACE)"
    "$PY" "$helper" trace-subset --src "$trace" --out "$carry/trace.npz" --tokens "${GPUCHECK_TRACE_TOKENS:-16384}"

    (cd "$carry" && find . -type f -printf '%P\n' | sort | xargs sha256sum) > "$tmp/manifest.txt"
    mv "$tmp/manifest.txt" "$carry/manifest.txt"
    local tree_kib carry_kib
    carry_kib=$(du -sk "$carry" | cut -f1)
    # (a tracked file deleted in the working tree makes du fail on its name; the total of the others stands)
    tree_kib=$(cd "$here" && git ls-files -z -co --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 \
        | cut -f1 || true)
    note "carry folder $carry: $((carry_kib / 1024)) MiB ($carry_kib KiB); working tree that travels: $((tree_kib / 1024)) MiB ($tree_kib KiB)"
    (( carry_kib + tree_kib < 48 * 1024 )) \
        || note "WARNING: tree + carry is $(((carry_kib + tree_kib) / 1024)) MiB, near the device tool's 64 MiB"
    du -sh "$carry"/* >&2
    cat >&2 <<EOF
[gpu-check] ready. On the device tool:
    run(command="scripts/gpu-check.sh run", carry=[".gpucheck"], timeout_s=570)
EOF
}

# ---------------------------------------------------------------------------------------------------------
# run (there): settings shared by the internal verbs (exported by run, read again by each)
# ---------------------------------------------------------------------------------------------------------
detect_mode() {
    local m=${GPUCHECK_MODE:-auto}
    if [ "$m" = auto ]; then
        if find_nvcc >/dev/null && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
            m=cuda
        else
            m=cpu
        fi
    fi
    case "$m" in cuda|cpu) echo "$m" ;; *) die "GPUCHECK_MODE must be auto, cuda or cpu, not '$m'" ;; esac
}

find_nvcc() {
    local c
    for c in "${GPUCHECK_NVCC:-}" /usr/local/cuda/bin/nvcc $(ls -d /usr/local/cuda-*/bin/nvcc 2>/dev/null | sort -V -r) \
             "$(command -v nvcc || true)"; do
        [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
    done
    return 1
}

# the cuBLAS headers and libraries: in the CUDA toolkit, or (pip-assembled toolkits) in Python's nvidia packages
find_cublas() {
    local root=$1 d
    if [ -n "${GPUCHECK_CUBLAS_DIR:-}" ]; then echo "$GPUCHECK_CUBLAS_DIR"; return 0; fi
    if [ -f "$root/include/cublas_v2.h" ] && ls "$root"/lib64/libcublas.so* >/dev/null 2>&1; then
        echo "$root"; return 0
    fi
    while read -r d; do
        for sub in nvidia/cu13 nvidia/cublas nvidia/cu12; do
            if [ -f "$d/$sub/include/cublas_v2.h" ] && ls "$d/$sub"/lib/libcublas.so* >/dev/null 2>&1; then
                echo "$d/$sub"; return 0
            fi
        done
    done < <("$PY" -c 'import site, sys; print("\n".join(dict.fromkeys(site.getsitepackages() + sys.path)))')
    return 1
}

# CMake arguments for llama-cpp-python with CUDA, fewest kernel variants: one architecture, no FlashAttention
# kernels (llama-cpp-python runs with flash_attn off unless asked), no fatbin compression, no NCCL, no VMM pool
# (no link against the driver's libcuda at build time), no llava/mtmd, no tests/tools/examples
cuda_cmake_args() {
    local nvcc=$1 cublas=$2 lib
    lib=$(ls "$cublas"/lib*/libcublas.so* | sort | tail -1)
    local lt
    lt=$(ls "$cublas"/lib*/libcublasLt.so* | sort | tail -1)
    echo "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${GPUCHECK_CUDA_ARCH:-90} -DCMAKE_CUDA_COMPILER=$nvcc" \
         "-DGGML_CUDA_FA=OFF -DGGML_CUDA_COMPRESSION_MODE=none -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_NO_VMM=ON" \
         "-DCUDA_cublas_LIBRARY=$lib -DCUDA_cublasLt_LIBRARY=$lt -DCMAKE_CUDA_FLAGS=-I$cublas/include"
}

COMMON_CMAKE="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"

# record STEP STATUS RC SECONDS BUDGET [NOTE]: one JSON line in $work/steps.jsonl
record() {
    local note=${6:-}
    note=${note//\"/\'}
    printf '{"step": "%s", "status": "%s", "rc": %d, "seconds": %.1f, "budget_s": %d, "note": "%s"}\n' \
        "$1" "$2" "$3" "$4" "$5" "$note" >> "$GPUCHECK_WORK/steps.jsonl"
}

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# step NAME BUDGET CMD...: CMD under `timeout` for min(BUDGET, time left before the summary's reserve)
step() {
    local name=$1 budget=$2
    shift 2
    local left=$(( GPUCHECK_DEADLINE - $(date +%s) - 15 ))
    if (( left < 20 )); then
        note "== $name: not run, no time left =="
        record "$name" no-time 0 0 0 "not run: the run's time (GPUCHECK_TIME_S) was spent"
        return 1
    fi
    (( budget > left )) && budget=$left
    note "== $name (budget ${budget} s, $(( GPUCHECK_DEADLINE - $(date +%s) )) s left) =="
    local t rc=0 status=ok
    t=$(now)
    timeout -k 10 "$budget" "$@" || rc=$?
    if (( rc == 124 || rc == 137 )); then status=timeout; elif (( rc != 0 )); then status=failed; fi
    record "$name" "$status" "$rc" "$(since "$t")" "$budget"
    note "== $name: $status ($(since "$t") s) =="
    return $rc
}

want() { [[ ",${GPUCHECK_PARTS}," == *",$1,"* ]]; }

# python -m ... from the work folder (the current folder comes first on sys.path: never the source tree's hybrimoe)
py() { (cd "$GPUCHECK_WORK" && "$PY" "$@"); }

# ---- internal verb: build both wheels (at once) and install them into $GPUCHECK_WORK/site --------------------
build() {
    local work=$GPUCHECK_WORK lcp_tgz src lcp_dir site=$GPUCHECK_WORK/site jobs=${GPUCHECK_JOBS:-$(nproc)}
    lcp_tgz=$(ls "$carry"/llama_cpp_python-*-trimmed.tar.gz 2>/dev/null | head -1)
    [ -n "$lcp_tgz" ] || die "no llama_cpp_python-*-trimmed.tar.gz in $carry: run 'scripts/gpu-check.sh prepare' first"
    [ -f "$carry/requirements.txt" ] || die "no requirements.txt in $carry: run 'scripts/gpu-check.sh prepare' again"
    local t
    t=$(now)
    src=$work/src
    rm -rf "$src" "$site" "$work/wheels"
    mkdir -p "$src" "$site" "$work/wheels" "$work/build"
    tar -xzf "$lcp_tgz" -C "$src"
    lcp_dir=$(ls -d "$src"/llama_cpp_python-*/ | head -1)
    tar -czf "$src/llama.cpp.tar.gz" -C "$lcp_dir/vendor" llama.cpp  # HYBRIMOE_LLAMA_SRC (prepare_source.py patches it)
    record build-unpack ok 0 "$(since "$t")" 0 "sources unpacked"
    # the runtime requirements the machine lacks, from the carry (a missing one is named now, not after the build)
    local rc_d=0
    t=$(now)
    "$PY" "$helper" install-deps --requirements "$carry/requirements.txt" --wheels "$carry/wheels" \
        --target "$site" || rc_d=$?
    record build-deps "$([ $rc_d = 0 ] && echo ok || echo failed)" $rc_d "$(since "$t")" 0 \
        "$([ $rc_d = 0 ] && echo "requirements.txt satisfied" || echo "a requirement is missing: see gpu-check.log")"

    local lcp_args="$COMMON_CMAKE" nice_cmd=() cuda_note="CPU only"
    if [ "$GPUCHECK_MODE" = cuda ]; then
        local nvcc cuda_root cublas
        nvcc=$(find_nvcc) || die "nvcc not found (set GPUCHECK_NVCC)"
        cuda_root=$(cd "$(dirname "$nvcc")/.." && pwd)
        cublas=$(find_cublas "$cuda_root") \
            || die "cuBLAS (cublas_v2.h, libcublas.so*) not found in $cuda_root or Python's nvidia packages; set GPUCHECK_CUBLAS_DIR"
        lcp_args="$lcp_args $(cuda_cmake_args "$nvcc" "$cublas")"
        cuda_note="CUDA: $("$nvcc" --version | tail -2 | head -1); cuBLAS from $cublas"
    else
        nice_cmd=(nice -n 10)  # CPU mode runs on shared development machines
    fi
    note "llama-cpp-python CMAKE_ARGS: $lcp_args"
    note "$cuda_note; $jobs parallel jobs per build"
    "$PY" - "$work/build-info.json" "$lcp_args" "$cuda_note" "$jobs" <<'EOF'
import json, sys
json.dump(dict(llama_cpp_python_cmake_args=sys.argv[2], toolchain=sys.argv[3], jobs=int(sys.argv[4])),
          open(sys.argv[1], "w"), indent=2)
EOF

    # hybrimoe's wheel (patched libllama, RPC backend, pybind11 modules) in the background: it does not need
    # llama-cpp-python at build time; CMAKE_ARGS stays empty (hybrimoe forces its own CPU-only link-time ggml)
    local th rc_h=0
    th=$(now)
    ( env CMAKE_ARGS="" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" HYBRIMOE_LLAMA_SRC="$src/llama.cpp.tar.gz" \
          HYBRIMOE_CACHE_DIR="$work/cache" SKBUILD_BUILD_DIR="$work/build/hybrimoe" \
          "${nice_cmd[@]}" "$PY" -m pip wheel -v --no-build-isolation --no-deps --no-index --no-cache-dir \
          -w "$work/wheels" "$here" > "$work/build-hybrimoe.log" 2>&1
      echo $? > "$work/build-hybrimoe.rc"; since "$th" > "$work/build-hybrimoe.s" ) &
    local hpid=$!

    local tl rc_l=0
    tl=$(now)
    env CMAKE_ARGS="$lcp_args" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" SKBUILD_BUILD_DIR="$work/build/llama-cpp-python" \
        "${nice_cmd[@]}" "$PY" -m pip wheel -v --no-build-isolation --no-deps --no-index --no-cache-dir \
        -w "$work/wheels" "$lcp_dir" > "$work/build-lcp.log" 2>&1 || rc_l=$?
    record build-llama-cpp-python "$([ $rc_l = 0 ] && echo ok || echo failed)" $rc_l "$(since "$tl")" 0 \
        "$([ "$GPUCHECK_MODE" = cuda ] && echo "CUDA sm_${GPUCHECK_CUDA_ARCH:-90}" || echo "CPU")"
    (( rc_l == 0 )) || { note "llama-cpp-python build failed; its log ends:"; tail -40 "$work/build-lcp.log" >&2; }
    wait "$hpid" || true
    rc_h=$(cat "$work/build-hybrimoe.rc" 2>/dev/null || echo 1)
    record build-hybrimoe "$([ "$rc_h" = 0 ] && echo ok || echo failed)" "$rc_h" \
        "$(cat "$work/build-hybrimoe.s" 2>/dev/null || echo 0)" 0 "ran alongside llama-cpp-python's build"
    (( rc_h == 0 )) || { note "hybrimoe build failed; its log ends:"; tail -40 "$work/build-hybrimoe.log" >&2; }
    (( rc_l == 0 && rc_h == 0 && rc_d == 0 )) || return 1

    t=$(now)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$work"/wheels/*.whl
    py -c 'import hybrimoe, llama_cpp
from hybrimoe import _ggml, _lib
print("hybrimoe", hybrimoe.__file__, "llama_cpp", llama_cpp.__file__)
for d in _ggml.devices(): print("  ggml device:", d["name"], "-", d["description"], "type", d["type"])'
    record build-install ok 0 "$(since "$t")" 0 "wheels installed into $site, import checked"
}

# ---- internal verb: one bench -------------------------------------------------------------------------------
bench() {
    local cache=$1 tag model trace
    tag=${cache%\%}
    model=$("$PY" -c 'import json,sys;print(json.load(open(sys.argv[1]))["model"])' "$GPUCHECK_WORK/bench-model.json")
    trace=$("$PY" -c 'import json,sys;print(json.load(open(sys.argv[1]))["trace"])' "$GPUCHECK_WORK/bench-model.json")
    local args=(bench -m "$model" --moe-cache "$cache" -p "$GPUCHECK_N_PROMPT" -n "$GPUCHECK_N_GEN"
                -r "$GPUCHECK_REPS" --policies "${GPUCHECK_POLICIES:-hybrimoe}"
                --upstream "${GPUCHECK_UPSTREAM:-exps,ncmoe}" --replay-trace "$trace"
                --json "$GPUCHECK_OUT/bench-$tag.json" --csv "$GPUCHECK_WORK/bench-$tag.csv")
    [ "$GPUCHECK_MODE" = cpu ] && args+=(--stand-in)
    [ -n "${GPUCHECK_THREADS:-}" ] && args+=(-t "$GPUCHECK_THREADS")
    [ -f "$GPUCHECK_WORK/calibration.json" ] && args+=(--moe-cost-model "$GPUCHECK_WORK/calibration.json")
    note "hybrimoe ${args[*]}"
    HYBRIMOE_PROGRESS=1 py -m hybrimoe "${args[@]}"
}

calibrate() {
    local model
    model=$("$PY" -c 'import json,sys;print(json.load(open(sys.argv[1]))["model"])' "$GPUCHECK_WORK/bench-model.json")
    rm -f "$GPUCHECK_WORK/calibration.json"
    py -m hybrimoe calibrate -m "$model" -o "$GPUCHECK_WORK/calibration.json" \
        ${GPUCHECK_THREADS:+-t "$GPUCHECK_THREADS"}
}

# ---- run: the steps ----------------------------------------------------------------------------------------
run_all() {
    local mode=$GPUCHECK_MODE out=$GPUCHECK_OUT work=$GPUCHECK_WORK
    note "mode $mode; results in $out; work folder $work; $(( GPUCHECK_DEADLINE - $(date +%s) )) s; parts $GPUCHECK_PARTS"
    note "knobs: layers $GPUCHECK_LAYERS, n_embd $GPUCHECK_N_EMBD, n_ff_exp $GPUCHECK_N_FF_EXP, n_ff_dense" \
         "$GPUCHECK_N_FF_DENSE, n_head $GPUCHECK_N_HEAD, pp $GPUCHECK_N_PROMPT, tg $GPUCHECK_N_GEN, reps $GPUCHECK_REPS," \
         "caches $GPUCHECK_CACHES"
    : > "$work/steps.jsonl"
    rm -f "$out"/bench-*.json "$out/correctness.json" "$work/calibration.json"
    local built=1
    if want build; then
        step build "${GPUCHECK_BUDGET_BUILD:-$([ "$mode" = cuda ] && echo 420 || echo 3000)}" "$self" _build || built=0
        # both build logs travel back as one file (cut to its last 15 MB if ever longer)
        { for f in "$work/build-lcp.log" "$work/build-hybrimoe.log"; do
              [ -f "$f" ] && { echo "===== $(basename "$f")"; cat "$f"; }
          done; } | tail -c 15000000 > "$out/build.log" || true
    elif [ -d "$work/site/hybrimoe" ] && [ -d "$work/site/llama_cpp" ]; then
        record build skipped 0 0 0 "not in GPUCHECK_PARTS; reusing $work/site"
    else
        record build skipped 0 0 0 "not in GPUCHECK_PARTS and no earlier build in $work/site"
        built=0
    fi
    if (( built )); then
        want correctness && step correctness "${GPUCHECK_BUDGET_CORRECTNESS:-$([ "$mode" = cuda ] && echo 90 || echo 900)}" \
            "$PY" "$helper" correctness --mode "$mode" --out "$out/correctness.json" --work "$work/tiny" \
            --models "${GPUCHECK_CORRECTNESS_MODELS:-qwen3moe:Q8_0,deepseek2:Q4_K_M,gpt-oss:MXFP4}" || true
        local have_model=0
        if want model || want bench || want calibrate; then
            step model "${GPUCHECK_BUDGET_MODEL:-$([ "$mode" = cuda ] && echo 90 || echo 600)}" \
                "$PY" "$helper" bench-model --out-dir "$work/model" --trace "$carry/trace.npz" \
                --info "$work/bench-model.json" --layers "$GPUCHECK_LAYERS" --n-embd "$GPUCHECK_N_EMBD" \
                --n-ff-exp "$GPUCHECK_N_FF_EXP" --n-ff-dense "$GPUCHECK_N_FF_DENSE" --n-head "$GPUCHECK_N_HEAD" \
                && have_model=1
        fi
        local bench_budget=${GPUCHECK_BUDGET_BENCH:-$([ "$mode" = cuda ] && echo 100 || echo 900)}
        local n_caches
        n_caches=$(wc -w <<< "$GPUCHECK_CACHES")
        if (( have_model )) && want calibrate; then
            local cal=${GPUCHECK_CALIBRATE:-auto} left=$(( GPUCHECK_DEADLINE - $(date +%s) - 15 ))
            if [ "$cal" = auto ]; then
                # a full calibration only on a GPU and only when the benches keep their budgets afterwards;
                # otherwise the engine measures a short one on first use (in the first bench) and stores it
                if [ "$mode" = cuda ] && (( left > n_caches * bench_budget + ${GPUCHECK_BUDGET_CALIBRATE:-90} )); then
                    cal=1
                else
                    cal=0
                fi
            fi
            if [ "$cal" = 1 ]; then
                step calibrate "${GPUCHECK_BUDGET_CALIBRATE:-90}" "$self" _calibrate || rm -f "$work/calibration.json"
            else
                record calibrate skipped 0 0 0 "GPUCHECK_CALIBRATE=${GPUCHECK_CALIBRATE:-auto} ($mode, ${left} s left)"
            fi
        fi
        if (( have_model )) && want bench; then
            local c
            for c in $GPUCHECK_CACHES; do
                step "bench-${c%\%}" "$bench_budget" "$self" _bench "$c" || true
            done
        fi
    fi
    # the summary always runs (the steps keep 15 s for it), whatever happened before
    timeout -k 5 60 "$PY" "$helper" summary --work "$work" --out-dir "$out" --mode "$mode" \
        --started "$GPUCHECK_STARTED" --t0 "$GPUCHECK_T0" || note "summary failed (rc $?)"
    note "done in $(( $(date +%s) - ${GPUCHECK_T0%.*} )) s"
}

run() {
    local out=${OUT:-${1:-}}
    [ -n "$out" ] || die "no output folder: set OUT, or give one: scripts/gpu-check.sh run DIR"
    mkdir -p "$out"
    export GPUCHECK_OUT
    GPUCHECK_OUT=$(cd "$out" && pwd)
    export GPUCHECK_WORK=${GPUCHECK_WORK:-/tmp/gpucheck-work}
    mkdir -p "$GPUCHECK_WORK"
    export GPUCHECK_MODE
    GPUCHECK_MODE=$(detect_mode)
    export GPUCHECK_T0 GPUCHECK_STARTED GPUCHECK_DEADLINE
    GPUCHECK_T0=$(date +%s)
    GPUCHECK_STARTED=$(date +%Y-%m-%dT%H:%M:%S%z)
    local small=0
    [ "$GPUCHECK_MODE" = cpu ] && small=1
    GPUCHECK_DEADLINE=$(( GPUCHECK_T0 + ${GPUCHECK_TIME_S:-$( ((small)) && echo 7200 || echo 540)} ))
    # the bench model and runs: DeepSeek-V2-Lite's shape on a GPU, scaled down in CPU mode
    export GPUCHECK_LAYERS=${GPUCHECK_LAYERS:-$( ((small)) && echo 3 || echo 8)}
    export GPUCHECK_N_EMBD=${GPUCHECK_N_EMBD:-$( ((small)) && echo 512 || echo 2048)}
    export GPUCHECK_N_FF_EXP=${GPUCHECK_N_FF_EXP:-$( ((small)) && echo 352 || echo 1408)}
    export GPUCHECK_N_FF_DENSE=${GPUCHECK_N_FF_DENSE:-$( ((small)) && echo 1024 || echo 10944)}
    export GPUCHECK_N_HEAD=${GPUCHECK_N_HEAD:-$( ((small)) && echo 4 || echo 16)}
    export GPUCHECK_N_PROMPT=${GPUCHECK_N_PROMPT:-$( ((small)) && echo 64 || echo 512)}
    export GPUCHECK_N_GEN=${GPUCHECK_N_GEN:-$( ((small)) && echo 16 || echo 128)}
    export GPUCHECK_REPS=${GPUCHECK_REPS:-$( ((small)) && echo 1 || echo 2)}
    export GPUCHECK_CACHES=${GPUCHECK_CACHES:-25% 50%}
    export GPUCHECK_PARTS=${GPUCHECK_PARTS:-build,correctness,model,calibrate,bench}
    # every Python step imports the hybrimoe and llama_cpp built here, never an installed copy
    export PYTHONPATH="$GPUCHECK_WORK/site"
    export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore HYBRIMOE_CACHE_DIR="$GPUCHECK_WORK/cache" OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
    if [ "$GPUCHECK_MODE" = cuda ]; then
        # run time: cudart from the toolkit, cuBLAS where the build found it
        local nvcc root cublas
        nvcc=$(find_nvcc) || true
        if [ -n "$nvcc" ]; then
            root=$(cd "$(dirname "$nvcc")/.." && pwd)
            cublas=$(find_cublas "$root" || true)
            export LD_LIBRARY_PATH="${cublas:+$cublas/lib:}$root/lib64:$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    fi
    set +e
    "$self" _run 2>&1 | tee "$GPUCHECK_OUT/gpu-check.log"
    local rc=${PIPESTATUS[0]}
    set -e
    return "$rc"
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) shift; run "$@" ;;
    _run) run_all ;;
    _build) build ;;
    _bench) bench "$2" ;;
    _calibrate) calibrate ;;
    -h|--help|help|"")
        sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
        [ -n "${1:-}" ] || exit 2 ;;
    *) die "unknown verb '$1' (prepare, run; --help)" ;;
esac
