#!/usr/bin/env bash
# Build a CUDA-aware Open MPI on this machine (no GPU, no CUDA toolkit needed), for benchmarks/gpu_check.sh's
# "cuda-mpi" parts on a lent GPU machine that reaches no index (docs/benchmarks.md, "CUDA-aware MPI").
#
#   benchmarks/build_cuda_ompi.sh [PREFIX]     # default /tmp/clusterctl-ompi; ~6 minutes on 2 cores, 14 MB
#
# Sources come from the package registries this machine reaches: Open MPI from Debian (apt-get source, a
# deb-src line added for the run), CUDA's cuda.h from NVIDIA's runtime wheel on PyPI. Open MPI 4.1 needs only
# the header at build time: it opens the driver's libcuda.so.1 at run time. On the GPU machine, put the prefix
# at the same path (it is compiled in: a symlink will do), then CUDA_MPI=PREFIX benchmarks/gpu_check.sh.
set -euo pipefail
PREFIX=${1:-/tmp/clusterctl-ompi}
PY=${PYTHON:-python3}
work=$(mktemp -d /tmp/clusterctl-ompi-build.XXXXXX)
cd "$work"
echo "building in $work, installing into $PREFIX"

src_list=/etc/apt/sources.list.d/clusterctl-debsrc.sources
trap 'rm -f "$src_list"' EXIT
sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$src_list"
apt-get update -qq
apt-get source -qq --download-only openmpi 2>/dev/null
tar xf openmpi_*.orig.tar.*
"$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 "nvidia-cuda-runtime==13.0.96" -d wheel
"$PY" -m zipfile -e wheel/nvidia_cuda_runtime-*.whl cudart
cuda=$work/cudart/nvidia/cu13
test -f "$cuda/include/cuda.h"

cd openmpi-*/
./configure --prefix="$PREFIX" --with-cuda="$cuda" \
    --disable-mpi-fortran --disable-oshmem --disable-io-romio --disable-mpi-cxx --disable-man-pages \
    --without-ucx --without-verbs --without-ofi --without-psm2 --without-libfabric --without-slurm --without-tm \
    --with-hwloc=internal --with-libevent=internal --with-pmix=internal --enable-shared --disable-static \
    > "$work/configure.log" 2>&1 || { tail -20 "$work/configure.log"; exit 1; }
grep -q "^CUDA support: yes" "$work/configure.log" || { echo "configure did not enable CUDA" >&2; exit 1; }
make -j"$(nproc)" > "$work/make.log" 2>&1 || { tail -30 "$work/make.log"; exit 1; }
make install > "$work/install.log" 2>&1
rm -rf "$PREFIX/include" "$PREFIX/share/man"
"$PREFIX/bin/ompi_info" --parsable --all 2>/dev/null | grep -m1 "mpi_built_with_cuda_support:value"
du -sh "$PREFIX"
