#!/usr/bin/env bash
# Build .gpu/: everything benches/gpu/run.sh needs on the GPU machine that does not travel with
# the working tree (run HERE, before a device call that carries ".gpu").
#
#   .gpu/wheels/      abi3 wheels of pyserve and pyserve-kernels (the Rust extensions: *.so is
#                     git-ignored, so the built modules never travel otherwise), and cp312 /
#                     pure-Python wheels of pyserve's runtime dependencies the device image lacks
#   .gpu/shared/models/stories260k/       the 1 MB Llama of ../shared (../shared stays behind);
#                                         run.sh points PYSERVE_SHARED here
#   .gpu/models/smollm2-<N>l.Q4_1.gguf    SmolLM2-135M-Instruct cut to its first N blocks (the
#                                         98 MB original is over the 64 MiB transfer limit)
#   .gpu/manifest.txt the hash of the Rust sources the wheels were built from (run.sh warns
#                     when the tree's differ) and what was packed
#
# Idempotent: wheels are rebuilt each run (cargo is incremental), dependency wheels come from a
# download cache, the truncated GGUF is rewritten only when stale. Fails if .gpu/ exceeds
# 60 MiB (the tree itself is ~1 MiB of the 64 MiB limit).
#
#   bash benches/gpu/pack.sh          # PYTHON=... picks the interpreter (default: pyserve's venv)
set -euo pipefail

cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PYTHON:-$HOME/.cache/pyserve-venv/bin/python}
MATURIN=${MATURIN:-$(dirname "$PY")/maturin}
GPU=.gpu
CACHE=${PYSERVE_GPU_CACHE:-$HOME/.cache/pyserve-gpu-pack}
# A target folder of its own: the pyo3 extension-module build would otherwise invalidate the
# shared one's `cargo test --release` artifacts (other clones and `make test` use it).
export CARGO_TARGET_DIR=$CACHE/target
HOST_WHEELS=$CACHE/host-wheels  # the pinned set for this interpreter (the dry run's)
BUDGET_MIB=55      # what .gpu/ aims at; the GGUF gets whatever the rest leaves
LIMIT_MIB=60       # hard stop
# Down to what the device's glibc runs: pyserve's own wheels are manylinux_2_34 and ran there
# (llguidance ships manylinux_2_31 only).
PLATFORMS=(manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
           manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

start_s=$SECONDS
mkdir -p "$GPU/wheels" "$GPU/models" "$GPU/shared/models" "$CACHE/deps" "$CACHE/build"
grep -qxF '/.gpu/' .gitignore || { echo "pack.sh: add /.gpu/ to .gitignore first" >&2; exit 1; }

echo "== pyserve and pyserve-kernels wheels (maturin, abi3)"
rm -rf "$CACHE/build" && mkdir -p "$CACHE/build"
"$MATURIN" build --release --quiet -i "$PY" -o "$CACHE/build" 2>&1 | tail -n 3
(cd kernels && "$MATURIN" build --release --quiet -i "$PY" -o "$CACHE/build") 2>&1 | tail -n 3

echo "== dependency wheels, pinned to the venv's versions (benches/gpu/pins.py)"
# pyserve's runtime closure minus what the device image has, at the versions the tests ran
# with: for CPython 3.12 (.gpu/wheels, the device's set) and for this venv's interpreter
# (HOST_WHEELS, what `run.sh --dry-run` installs here: the same pins).
pins=$("$PY" benches/gpu/pins.py closure) || { echo "pack.sh: cannot pin pyserve's closure" >&2; exit 1; }
echo "  $(echo $pins)"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platform_args[@]}" -d "$CACHE/deps" $pins
rm -rf "$HOST_WHEELS" && mkdir -p "$HOST_WHEELS"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$HOST_WHEELS" $pins
rm -f "$GPU"/wheels/*.whl
cp "$CACHE"/build/*.whl "$GPU/wheels/"
for pin in $pins; do
    name=${pin%%==*}; version=${pin##*==}
    # wheel file names use the normalized name with '_' (PEP 427); cp312 or pure Python
    file=$(ls "$CACHE/deps/${name//-/_}-${version}-"*{cp312,py3,abi3}*.whl 2>/dev/null | head -n 1 || true)
    [[ -n $file ]] || { echo "pack.sh: no CPython 3.12 wheel of $pin in $CACHE/deps" >&2; exit 1; }
    cp "$file" "$GPU/wheels/"
done
"$PY" benches/gpu/pins.py check "$GPU/wheels" || exit 1
"$PY" benches/gpu/pins.py check "$HOST_WHEELS" || exit 1
"$PY" benches/gpu/check_wheel_deps.py "$GPU/wheels"

echo "== stories260k"
rm -rf "$GPU/shared/models/stories260k"
cp -r "${PYSERVE_SHARED:-$REPO/../shared}/models/stories260k" "$GPU/shared/models/"
chmod -R u+w "$GPU/shared"

echo "== SmolLM2 cut to the blocks that fit"
src=$("$PY" -c "from pyserve.model_loader.default_model import default_model_path as d; print(d())")
rest_bytes=$(du -cb --exclude='*.gguf' "$GPU" | tail -n 1 | cut -f1)
max_bytes=$(( BUDGET_MIB * 1048576 - rest_bytes ))
gguf=$(ls "$GPU"/models/smollm2-*.gguf 2>/dev/null | head -n 1 || true)
if [[ -n $gguf && $gguf -nt $src && $gguf -nt benches/gpu/truncate_gguf.py
      && $(stat -c %s "$gguf") -le $max_bytes ]]; then
    echo "up to date: $gguf"
else
    rm -f "$GPU"/models/smollm2-*.gguf
    "$PY" benches/gpu/truncate_gguf.py "$src" "$GPU/models/smollm2.tmp.gguf" --max-bytes "$max_bytes"
    layers=$("$PY" -c "import gguf, sys; print(gguf.GGUFReader(sys.argv[1]).fields['llama.block_count'].contents())" \
             "$GPU/models/smollm2.tmp.gguf")
    gguf=$GPU/models/smollm2-${layers}l.Q4_1.gguf
    mv "$GPU/models/smollm2.tmp.gguf" "$gguf"
fi

echo "== the truncated GGUF loads in pyserve (CPU, float32, 8 greedy tokens)"
"$PY" - "$gguf" <<'EOF'
import sys
import pyserve
with pyserve.Engine(model_path=sys.argv[1], dtype="float32", device="cpu", max_total_tokens=1024,
                    log_level="warning") as engine:
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 8,
                                                        "ignore_eos": True})
assert len(out["output_ids"]) == 8, out
print(f"  ids {out['output_ids']} text {out['text']!r}")
EOF

echo "== manifest"
rust_hash=$(bash benches/gpu/rust_hash.sh)
{
    echo "rust_sources_sha256 $rust_hash"
    echo "packed_at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "smollm2 $gguf"
    (cd "$GPU/wheels" && ls -1 *.whl)
} > "$GPU/manifest.txt"

total_bytes=$(du -cb "$GPU" | tail -n 1 | cut -f1)
total_mib=$(( (total_bytes + 1048575) / 1048576 ))
echo "== .gpu/ is $(( total_bytes / 1024 )) KiB (~${total_mib} MiB) after $(( SECONDS - start_s )) s"
du -sh "$GPU"/wheels "$GPU"/shared "$GPU"/models
if (( total_bytes > LIMIT_MIB * 1048576 )); then
    echo "pack.sh: .gpu/ is over ${LIMIT_MIB} MiB" >&2
    exit 1
fi
