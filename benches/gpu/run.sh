#!/usr/bin/env bash
# The GPU device check, run THERE from the repository root after `bash benches/gpu/pack.sh`
# HERE (the device call carries ".gpu"):
#
#   bash benches/gpu/run.sh             # on the GPU machine: install, then (a) (b) (c)
#   bash benches/gpu/run.sh --dry-run   # here, on CPU: everything but the GPU work
#
# Install: the wheels of .gpu/wheels go into /tmp/site with pip --no-index --no-deps (the
# machine has no network), PYTHONPATH=/tmp/site. The tree's own Python sources are then laid
# over the installed pyserve and pyserve_kernels (so edits made after pack.sh count), and the
# native modules (_rs, _cpu: git-ignored, so they never travel) are copied into the tree's
# copy on that machine, where pytest imports pyserve from; run.sh warns when the Rust sources
# changed since pack.sh built them.
#
# Steps, each under its own `timeout`, all of them within TOTAL_S (default 520 s, so the
# script ends inside 9 minutes); a step gets its cap or what is left, whichever is less:
#   (a) pytest -q -m gpu $GPU_TESTS        the GPU-marked tests          (cap PYTEST_S=60)
#   (b) benches/gpu/check_greedy.py        backends agree on greedy ids  (cap GREEDY_S=90)
#   (c) benches/gpu/bench_decode.py        kernels, decode, throughput   (cap BENCH_S=240)
#   (d) pyserve bench host                 the host path on a simulated 2 ms device, 64 and
#                                          256 clients streamed, overlap on, the client on
#                                          cores of its own                  (cap HOST_S=100)
#   (e) benches/gpu/check_tp.py            tp 2 gives tp 1's greedy ids, graphs on and off,
#                                          and bench one-batch at tp 1 and 2 (cap TP_S=90);
#                                          on a one-GPU machine skipped, with a note
# Logs and results go under ${OUT:-/tmp/out} (at most 8 files: what the device tool returns);
# the summary table is printed last, one line per step. benches/gpu/README.md tells the rest.
#
# --dry-run (here, with the project's venv): installs into a temporary --target (the whole
# set for CPython 3.12, as there, and separately the same pins for this interpreter, which
# pyserve is then imported from), collects the GPU tests without running them, and runs (b)
# and (c) with --device cpu --tiny, (d) with 4 clients, short requests and overlap on, and (e)
# on CPU (gloo).
set -uo pipefail

cd "$(dirname "$0")/../.."
REPO=$PWD
DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    *) echo "usage: bash benches/gpu/run.sh [--dry-run]" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
# there the image's python3; here (dry run) the project's venv, which has torch and the rest
if [[ $DRY == 1 && -x $HOME/.cache/pyserve-venv/bin/python ]]; then
    PY=${PYTHON:-$HOME/.cache/pyserve-venv/bin/python}
else
    PY=${PYTHON:-python3}
fi
TOTAL_S=${TOTAL_S:-520}
# Where the GPU-marked tests live: the e2e folder imports test-only packages (jsonschema,
# hypothesis-jsonschema) the device image lacks; the dry run checks nothing GPU-marked is elsewhere.
GPU_TESTS="tests/kernels tests/unit"
BENCH_PARTS=${BENCH_PARTS:-kernels,decode,throughput}  # bench_decode.py --parts
start_s=$SECONDS
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
die() { say "run.sh: $*"; exit 1; }

[[ -d .gpu/wheels ]] || die "no .gpu/wheels: run 'bash benches/gpu/pack.sh' here first and carry .gpu"
say "== pyserve GPU check ($([[ $DRY == 1 ]] && echo dry run || echo device run)), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
if command -v nvidia-smi >/dev/null; then
    say "$(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1)"
fi
packed=$(awk '/^rust_sources_sha256/ {print $2}' .gpu/manifest.txt 2>/dev/null || true)
if [[ $packed != "$(bash benches/gpu/rust_hash.sh)" ]]; then
    say "WARNING: the Rust sources differ from those .gpu/wheels was built from: re-run pack.sh"
fi

declare -a NAMES RCS SECS STATES  # one summary row per step, the install included
install_t0=$SECONDS

# ---------------------------------------------------------------- install
pip_install() {  # pip_install TARGET WHEEL... [extra pip flags via PIP_EXTRA]
    local target=$1; shift
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$target" ${PIP_EXTRA:-} "$@" >>"$OUT/install.log" 2>&1
}
: > "$OUT/install.log"
overlay_sources() {  # overlay_sources SITE: the tree's Python files over the installed packages
    local site=$1 pkg
    for pkg in pyserve kernels/pyserve_kernels; do
        tar -C "$pkg" --exclude='*.so' --exclude=__pycache__ -cf - . \
            | tar -C "$site/$(basename "$pkg")" -xf - || return 1
    done
}
if [[ $DRY == 1 ]]; then
    SITE=$(mktemp -d /tmp/pyserve-gpu-site.XXXXXX)
    trap 'rm -rf "$SITE"' EXIT
    # the whole set, for the device's CPython 3.12: the install there must not refuse it
    PIP_EXTRA="--python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64 \
--platform manylinux_2_31_x86_64 \
--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
--platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --only-binary=:all:" \
        pip_install "$SITE/py312" .gpu/wheels/*.whl || die "the wheels do not install for CPython 3.12 (see $OUT/install.log)"
    # the same pins for this interpreter (pack.sh downloaded them), with pyserve's own wheels
    host_wheels=${PYSERVE_GPU_CACHE:-$HOME/.cache/pyserve-gpu-pack}/host-wheels
    "$PY" benches/gpu/pins.py check "$host_wheels" >>"$OUT/install.log" 2>&1 \
        || die "$host_wheels is not the venv's pinned set: re-run pack.sh (see $OUT/install.log)"
    loadable=(.gpu/wheels/pyserve-*.whl .gpu/wheels/pyserve_kernels-*.whl "$host_wheels"/*.whl)
    pip_install "$SITE/site" "${loadable[@]}" || die "install failed (see $OUT/install.log)"
    overlay_sources "$SITE/site" || die "could not lay the tree's sources over the wheels"
    export PYTHONPATH=$SITE/site
    where=$(cd /tmp && "$PY" -c "import pyserve, pyserve_kernels, pyserve._rs, pyserve_kernels._cpu, pydantic; print(pyserve.__file__)" 2>>"$OUT/install.log") \
        || die "pyserve does not import from the wheels: $(tail -n 1 "$OUT/install.log")"
    [[ $where == "$SITE/site/"* ]] || die "pyserve imported from $where, not from the wheels"
    install_note="CPython 3.12 set, and ${#loadable[@]} pinned wheels here; pyserve from them"
    say "installed the pinned set for this interpreter (${#loadable[@]} wheels) into $SITE/site; pyserve from there"
else
    SITE=/tmp/site
    pip_install "$SITE" .gpu/wheels/*.whl || die "install failed (see $OUT/install.log)"
    # The tree's Python over the wheels' copies (for the scripts), and the wheels' native
    # modules into the tree (pytest imports pyserve from the repository root).
    overlay_sources "$SITE" && cp "$SITE"/pyserve/_rs*.so pyserve/ \
        && cp "$SITE"/pyserve_kernels/_cpu*.so kernels/pyserve_kernels/ \
        || die "could not lay the tree's sources over the wheels"
    export PYTHONPATH=$SITE
    install_note="$(ls .gpu/wheels/*.whl | wc -l) wheels; the tree's sources with their native modules"
    say "installed $(ls .gpu/wheels/*.whl | wc -l) wheels into $SITE; the tree's sources run with their native modules"
fi
export PYSERVE_SHARED=$REPO/.gpu/shared
say "$("$PY" -c 'import sys, torch, triton, transformers; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}, cuda {torch.cuda.is_available()}")' 2>&1)"

# the device returns 8 files at most: a passed install's log gives its place to check_tp's
[[ $DRY == 0 ]] && rm -f "$OUT/install.log"
NAMES+=("install"); RCS+=(0); SECS+=($(( SECONDS - install_t0 ))); STATES+=("passed ($install_note)")

# ---------------------------------------------------------------- steps
run_step() {  # run_step NAME CAP_S LOG CMD...
    local name=$1 cap=$2 log=$3; shift 3
    local left=$(( TOTAL_S - (SECONDS - start_s) ))
    local limit=$(( cap < left ? cap : left ))
    if (( limit < 10 )); then
        NAMES+=("$name"); RCS+=("-"); SECS+=(0); STATES+=("not run: out of time"); return
    fi
    echo "== $name (timeout ${limit}s) -> $log"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    local state=passed
    case $rc in
        0) ;;
        5) [[ $name == pytest* ]] && state="no test selected" || state=failed ;;
        124|137) state="TIMED OUT after ${limit}s" ;;
        *) state=FAILED ;;
    esac
    [[ $name == pytest* ]] && state="$state ($(tail -n 1 "$log" | tr -s ' =' ' ' | cut -c1-70))"
    NAMES+=("$name"); RCS+=("$rc"); SECS+=($(( SECONDS - t0 ))); STATES+=("$state")
    grep -v -e '^nanobind' -e '^ - ' -e '^See https://nanobind' "$log" | tail -n 2
}

# The host path against a simulated 2 ms device: streamed, overlap on (~30 s a row), the
# tokenizer of the packed SmolLM2. On a machine with cores to spare the load generator gets
# cores of its own (taskset), so it does not starve the server.
host_args=(--model-path "$(ls .gpu/models/smollm2-*.gguf | head -n 1)" --decode-step-ms 2 --stream on)
client_cpus=()
ncpu=$(nproc)
(( ncpu >= 8 )) && client_cpus=(--client-cpus "$(( ncpu * 3 / 4 ))-$(( ncpu - 1 ))")

if [[ $DRY == 1 ]]; then
    run_step "pytest -m gpu (collect only)" "${PYTEST_S:-60}" "$OUT/pytest.log" \
        "$PY" -m pytest -q -m gpu --collect-only -p no:cacheprovider $GPU_TESTS
    # the device run collects only $GPU_TESTS: a GPU-marked test elsewhere would never run
    outside=$("$PY" -m pytest -q -m gpu --collect-only -p no:cacheprovider tests/ 2>/dev/null \
        | grep '::' | grep -v -e '^tests/kernels/' -e '^tests/unit/')
    NAMES+=("GPU tests only under $GPU_TESTS"); SECS+=(0)
    if [[ -z $outside ]]; then RCS+=(0); STATES+=(passed); else RCS+=(1); STATES+=("FAILED: $outside"); fi
    run_step "check_greedy --device cpu --tiny" "${GREEDY_S:-90}" "$OUT/check_greedy.log" \
        "$PY" benches/gpu/check_greedy.py --device cpu --tiny
    run_step "bench_decode --device cpu --tiny" "${BENCH_S:-240}" "$OUT/bench_decode.log" \
        "$PY" benches/gpu/bench_decode.py --device cpu --tiny
    run_step "bench host (tiny, CPU)" "${HOST_S:-100}" "$OUT/bench_host.log" \
        "$PY" -m pyserve bench host "${host_args[@]}" --overlap on --clients 4 --input-len 32 --output-len 16
    run_step "check_tp --device cpu" "${TP_S:-90}" "$OUT/check_tp.log" \
        "$PY" benches/gpu/check_tp.py --device cpu
else
    run_step "pytest -m gpu" "${PYTEST_S:-60}" "$OUT/pytest.log" \
        "$PY" -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS
    run_step "check_greedy" "${GREEDY_S:-90}" "$OUT/check_greedy.log" \
        "$PY" benches/gpu/check_greedy.py
    run_step "bench_decode" "${BENCH_S:-240}" "$OUT/bench_decode.log" \
        "$PY" benches/gpu/bench_decode.py --parts "$BENCH_PARTS"
    run_step "bench host" "${HOST_S:-100}" "$OUT/bench_host.log" \
        "$PY" -m pyserve bench host "${host_args[@]}" --overlap on --clients 64 256 \
        "${client_cpus[@]}" --requests-per-client 2
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    if (( gpus >= 2 )); then
        run_step "check_tp (tp 2)" "${TP_S:-90}" "$OUT/check_tp.log" "$PY" benches/gpu/check_tp.py
    else
        NAMES+=("check_tp (tp 2)"); RCS+=("-"); SECS+=(0)
        STATES+=("skipped: $gpus GPU(s); tensor parallelism 2 needs two")
    fi
fi

# ---------------------------------------------------------------- summary
table_of() {  # table_of LOG TITLE: the table a script printed last, or its progress lines
    local log=$1 title=$2
    if grep -q "^== $title" "$log" 2>/dev/null; then
        sed -n "/^== $title/,\$p" "$log" | grep -v -e '^nanobind' -e '^ - ' -e '^See https://nanobind'
    elif [[ -f $log ]]; then
        echo "== $title: no table (cut short?); its last progress lines:"
        grep '^  ' "$log" | tail -n 25
    fi
}
{
    echo
    table_of "$OUT/check_greedy.log" "check_greedy on"
    echo
    table_of "$OUT/bench_decode.log" "bench_decode on"
    echo
    if [[ -f $OUT/check_tp.log ]]; then
        grep -v -e '^nanobind' -e '^ - ' -e '^See https://nanobind' -e '^  ' "$OUT/check_tp.log" | tail -n 14
        echo
    fi
    if [[ -f $OUT/bench_host.log ]]; then
        echo "== bench host (simulated device; loop and writer CPU per generated token)"
        grep -v -e '^nanobind' -e '^ - ' -e '^See https://nanobind' "$OUT/bench_host.log" | tail -n 12
        echo
    fi
    echo "== summary ($(( SECONDS - start_s )) s in all; logs in $OUT)"
    printf '%-36s | %-4s | %-6s | %s\n' step rc time status
    for i in "${!NAMES[@]}"; do
        printf '%-36s | %-4s | %5ss | %s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}" "${STATES[$i]}"
    done
} | tee -a "$SUMMARY"
for s in "${STATES[@]}"; do
    [[ $s == passed* || $s == "no test selected"* || $s == skipped* ]] || exit 1
done
