#!/usr/bin/env bash
# Build the vLLM 0.26.0 bundle for an H200 GPU machine without network, on a CPU machine with PyPI.
#   cd <your checkout> && bash <this folder>/vllm-prepare.sh   # -> .vllm-parts/p1[/p2 ...]
# Env: WORK (scratch, default /tmp/vllm-prep), WHEELS (dir with wheels already
#      downloaded, optional), KEEP_MOE=1 (keep the MoE kernels, +20 MB: 2 parts),
#      KEEP_FA2=1 (keep the FlashAttention-2 kernels, +~60 MB: one more part).
# Output: parts of at most 60 MiB in <repo>/.vllm-parts/pN/ (ignored through
#         .git/info/exclude), each with MANIFEST; copy the pN folders to the GPU machine.
# Needs: python3 with pip (any 3.x; wheels are fetched for cp312/manylinux x86_64),
#        xz, split, sha256sum. Takes ~3 min (xz -9 on 2 cores); ~1.5 GB in WORK.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=${REPO:-$(git rev-parse --show-toplevel 2>/dev/null || pwd)}   # the checkout you run it from
WORK=${WORK:-/tmp/vllm-prep}
KEEP_MOE=${KEEP_MOE:-0}
KEEP_FA2=${KEEP_FA2:-0}
PARTSZ=${PARTSZ:-60m}
export PIP_CONFIG_FILE=/dev/null     # plain PyPI, no local find-links
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64)

mkdir -p "$WORK/whl"
rm -rf "$WORK/site" && mkdir -p "$WORK/site"
if [ -n "${WHEELS:-}" ]; then cp -n "$WHEELS"/vllm-0.26.0-*.whl "$WORK/whl/" 2>/dev/null || true; fi
grep -v '^\s*#' "$HERE/vllm-device-wheels.txt" | grep -v '^\s*$' > "$WORK/reqs.txt"
echo "== download (skips wheels already in $WORK/whl)"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" -r "$WORK/reqs.txt"

echo "== unpack vllm, drop what an H200 does not use"
VW=$(ls "$WORK"/whl/vllm-0.26.0-*.whl)
python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$VW" "$WORK/site"
V=$WORK/site/vllm
rm -f "$V/vllm-rs"                                   # Rust frontend, only with VLLM_USE_RUST_FRONTEND=1 (43 MB)
[ "$KEEP_FA2" = 1 ] || rm -f "$V/vllm_flash_attn/_vllm_fa2_C.abi3.so"   # 305 MB; sm_90 uses FA3
[ "$KEEP_MOE" = 1 ] || rm -f "$V/_moe_C_stable_libtorch.abi3.so"         # MoE-only kernels
rm -f "$V"/third_party/deep_gemm/_C.cpython-31[0134]-*.so      # other Pythons
rm -rf "$V/third_party/fmha_sm100/cutlass"                     # Blackwell-only headers
for so in "$V/_C_stable_libtorch.abi3.so" "$V/_moe_C_stable_libtorch.abi3.so"; do
  [ -f "$so" ] && python3 "$HERE/vllm_fatbin_compact.py" "$so" "$so.tmp" 90 && mv "$so.tmp" "$so"
done
chmod -R u+rwX,go+rX "$WORK/site"

echo "== install the other wheels into the same tree"
grep -v '^vllm==' "$WORK/reqs.txt" > "$WORK/reqs-deps.txt"
python3 -m pip install -q --no-index --find-links "$WORK/whl" --no-deps --no-compile \
  --target "$WORK/site" "${PLAT[@]}" -r "$WORK/reqs-deps.txt"
du -sh "$WORK/site"

echo "== tar | xz -9"
tar -C "$WORK/site" -cf - . | xz -9 -T0 > "$WORK/vllm-site.tar.xz"
SHA=$(sha256sum "$WORK/vllm-site.tar.xz" | cut -d' ' -f1)
rm -rf "$WORK/split" && mkdir -p "$WORK/split"
split -b "$PARTSZ" -d -a 2 "$WORK/vllm-site.tar.xz" "$WORK/split/vllm-site.tar.xz.part"

echo "== parts -> $REPO/.vllm-parts"
EXCL=$(git -C "$REPO" rev-parse --git-path info/exclude 2>/dev/null || echo "$REPO/.git/info/exclude"); case $EXCL in /*) ;; *) EXCL=$REPO/$EXCL;; esac
grep -qxF '/.vllm-parts/' "$EXCL" 2>/dev/null || { mkdir -p "$(dirname "$EXCL")"; echo '/.vllm-parts/' >> "$EXCL"; }
rm -rf "$REPO/.vllm-parts" && mkdir -p "$REPO/.vllm-parts"
{ echo "sha256 $SHA"; for f in "$WORK"/split/*; do echo "part $(basename "$f")"; done; } > "$WORK/MANIFEST"
i=0
for f in "$WORK"/split/*; do
  i=$((i+1)); mkdir -p "$REPO/.vllm-parts/p$i"
  cp "$f" "$WORK/MANIFEST" "$REPO/.vllm-parts/p$i/"
done
cat "$WORK/MANIFEST"; du -sh "$REPO"/.vllm-parts/p*
echo "copy .vllm-parts/p1 (then p2 ...) to the GPU machine; see vllm-on-device.md"
