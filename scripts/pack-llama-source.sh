#!/usr/bin/env bash
# Pack a trimmed, unpatched llama.cpp tree (about 4 MB) for machines without network, e.g. the GPU machine:
#   scripts/pack-llama-source.sh OUT.tar.gz [SDIST]
# then there: HYBRIMOE_LLAMA_SRC=OUT.tar.gz pip install --no-build-isolation .
# The tree is taken from the pinned sdist (fetched by pip if SDIST is not given) and keeps only what the build
# reads (docs/design.md §11): CMake files, ggml without the backends hybrimoe never builds, src, include,
# common, vendor, tools/rpc. prepare_source.py patches it like the sdist.
set -euo pipefail
out=${1:?usage: $0 OUT.tar.gz [SDIST]}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sdist=${2:-}
if [ -z "$sdist" ]; then
    python3 -m pip download --no-deps --no-binary llama-cpp-python --no-build-isolation -d "$work" \
        "llama-cpp-python==$(python3 -c "import json;print(json.load(open('$here/vendor/llama.cpp/pin.json'))['version'])")" >&2
    sdist=$(ls "$work"/llama_cpp_python-*.tar.gz)
fi
tar -xzf "$sdist" -C "$work"
src=$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)
dst="$work/llama.cpp"
mkdir -p "$dst/tools" "$dst/ggml/src"
cp -r "$src"/CMakeLists.txt "$src"/cmake "$src"/src "$src"/include "$src"/common "$src"/vendor "$src"/licenses "$dst"/ 2>/dev/null || true
cp -r "$src"/tools/rpc "$dst/tools/"
cp -r "$src"/ggml/CMakeLists.txt "$src"/ggml/cmake "$src"/ggml/include "$dst/ggml/"
for d in "$src"/ggml/src/*; do
    case "$(basename "$d")" in
        ggml-vulkan|ggml-sycl|ggml-cann|ggml-hexagon|ggml-openvino|ggml-webgpu|ggml-musa|ggml-opencl|ggml-metal|ggml-zdnn|ggml-virtgpu) ;;
        *) cp -r "$d" "$dst/ggml/src/" ;;
    esac
done
# the top-level CMakeLists.txt adds these directories; keep their CMake files (they are not built)
for d in tests tools examples pocs; do
    [ -f "$src/$d/CMakeLists.txt" ] && mkdir -p "$dst/$d" && cp "$src/$d/CMakeLists.txt" "$dst/$d/"
done
tar -czf "$out" -C "$work" llama.cpp
echo "wrote $out ($(du -h "$out" | cut -f1))"
