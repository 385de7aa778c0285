#!/usr/bin/env bash
# Print one sha256 over the Rust sources the native modules are built from (Cargo files,
# rust/, kernels/cpu/), with no git needed: pack.sh records it, run.sh compares, so a run on
# wheels older than the tree's Rust code says so.
set -euo pipefail
cd "$(dirname "$0")/../.."
find Cargo.toml Cargo.lock rust kernels/cpu -type f \( -name '*.rs' -o -name 'Cargo.toml' -o -name 'Cargo.lock' \) \
    -not -path '*/target/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
