#!/usr/bin/env bash
# The whole engine for a GPU machine whose image lacks Open MPI and oneDNN
# (docs/gpu.md): `meshtrain` as built here (the CUDA backend for sm_80 / sm_90
# beside the CPU one), every shared library it and Open MPI's / PMIx's plugins
# load, the dynamic loader and C library they were linked against (so the
# image's own glibc does not matter), and the KJV as byte tokens for the
# training runs gpu_check.sh makes. Packed as build/gpu-bundle.tar.xz, which
# the device tool carries (<= 64 MiB with build/gpu-vendor).
#
# Run on a CPU machine set up by scripts/setup.sh, after the build:
#   bash scripts/gpu_bundle.sh [build/meshtrain]
# Then `build/gpu-bundle/meshtrain ARGS` runs it anywhere on x86-64 Linux, one
# process (MPI's singleton, no mpirun, no daemon).
set -euo pipefail
cd "$(dirname "$0")/.."
binary=${1:-build/meshtrain}
stage=build/gpu-bundle
[[ -x $binary ]] || { echo "gpu_bundle: $binary is not built (cmake --build build)" >&2; exit 1; }
multiarch=/usr/lib/$(gcc -print-multiarch)
ompi_plugins=$multiarch/openmpi/lib/openmpi3
pmix_plugins=$multiarch/pmix2/lib/pmix
for d in "$ompi_plugins" "$pmix_plugins"; do
  [[ -d $d ]] || { echo "gpu_bundle: $d not found (Debian's openmpi-bin / libpmix2)" >&2; exit 1; }
done

rm -rf "$stage" "$stage.tar.xz"
mkdir -p "$stage/bin" "$stage/lib" "$stage/data"
cp "$binary" "$stage/bin/meshtrain"
cp -r "$ompi_plugins" "$stage/lib/openmpi3"
cp -r "$pmix_plugins" "$stage/lib/pmix"
# Every library the binary and the plugins resolve, and the loader.
{ ldd "$binary"; find "$stage/lib/openmpi3" "$stage/lib/pmix" -name '*.so' -exec ldd {} \; ; } |
  awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\/.*ld-linux/ {print $1}' | sort -u |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done

# The training runs' data: the KJV as byte tokens.
text=build/kjv-text
[[ -d $text ]] || bash scripts/kjv_text.sh "$text"
"$binary" prepare --input "$text" --out "$stage/data/bytes" --tokenizer bytes --val-fraction 0.05 \
  > /dev/null

cat > "$stage/meshtrain" <<'EOF'
#!/bin/sh
# meshtrain with the bundle's libraries and loader, one process (an MPI singleton).
here=$(cd "$(dirname "$0")" && pwd)
export OMPI_MCA_mca_base_component_path="$here/lib/openmpi3"
export PMIX_MCA_mca_base_component_path="$here/lib/pmix"
export OMPI_MCA_ess_singleton_isolated=1
export OMPI_MCA_mca_base_component_show_load_errors=0
exec "$here/lib/ld-linux-x86-64.so.2" --library-path "$here/lib" "$here/bin/meshtrain" "$@"
EOF
chmod +x "$stage/meshtrain"
tar -cJf "$stage.tar.xz" -C build gpu-bundle
echo "gpu_bundle: $(du -sh "$stage" | cut -f1) in $stage, $(du -h "$stage.tar.xz" | cut -f1) packed"
