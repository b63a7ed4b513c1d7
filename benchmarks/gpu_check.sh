#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("GPU: ..."), as one script for a machine with a CUDA device and
# PyTorch (issue 23, part 6). Run from anywhere:
#
#   benchmarks/gpu_check.sh                      # with clusterctl's dependencies and the MPI wheels installed
#   WHEELS=.whl benchmarks/gpu_check.sh          # a machine with no package index: install these wheels first
#   CUDA_MPI=/opt/ompi-cuda benchmarks/gpu_check.sh  # also the parts under an MPI built with CUDA (Open MPI's
#                                                # prefix: its bin/mpirun and lib/libmpi.so.40)
#   PARTS="cuda-mpi" benchmarks/gpu_check.sh     # only these parts (machine doctor provision collective nccl
#                                                # top bench cuda-mpi; all of them by default)
#
# Each part prints a "== part" line; the script exits non-zero when a check failed.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
UCX_LOG_LEVEL=error
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 UCX_LOG_LEVEL
if [ -n "${WHEELS:-}" ]; then
    # a prefix of its own (MPICH's wheel puts mpiexec in bin/ and libmpi in lib/, where mpi4py finds it)
    "$PY" -m pip install -q --prefix /tmp/clusterctl-gpu --no-index --no-deps --no-compile \
        --no-warn-script-location "$WHEELS"/*.whl || exit 1
    site=$(echo /tmp/clusterctl-gpu/lib/python3*/site-packages)
    export PYTHONPATH="$site:$PWD" PATH="/tmp/clusterctl-gpu/bin:$PATH"
    export LD_LIBRARY_PATH="/tmp/clusterctl-gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
rc=0
part() { echo; echo "== $* ($(date +%T))"; }
want() { [ -z "${PARTS:-}" ] || [[ " $PARTS " == *" $1 "* ]]; }

part machine
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import sys, torch, mpi4py; from mpi4py import MPI; print('python', sys.version.split()[0], '| torch',
torch.__version__, 'CUDA', torch.version.cuda, '| mpi4py', mpi4py.__version__, '|',
MPI.Get_library_version().splitlines()[0].strip())" || rc=1
echo "mpiexec: $(command -v mpiexec)"

if want doctor; then
part "doctor: the host facts script against the driver"
"$PY" benchmarks/gpu.py facts || rc=1
fi

if want provision; then
part "provisioning: the gpu step (driver check, CUDA and NCCL wheels)"
timeout 300 "$PY" benchmarks/gpu.py provision || rc=1
fi

want collective && for n in 1 2; do
    for aware in "" 0; do
        part "collective GPU tests: mpi_cases.py under mpiexec -n $n${aware:+, CLUSTERCTL_COLLECTIVE_CUDA_AWARE=$aware}"
        CLUSTERCTL_COLLECTIVE_CUDA_AWARE=$aware timeout 300 mpiexec -n $n "$PY" -m pytest -q -rs -p no:cacheprovider \
            tests/collective/mpi_cases.py -k "cuda or cupy" 2>&1 | grep -vE "durations|^$|^[0-9.]+s (call|setup|teardown)"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
done

if want nccl; then
part "NCCL: two ranks on one GPU"
timeout 120 mpiexec -n 2 "$PY" benchmarks/gpu.py nccl-probe 2>&1 | grep -E "^rank|Error" | head -4
fi

if want top; then
part "status and top of a GPU job (backend: local), then stop"
work=$(mktemp -d) && cp benchmarks/gpu_top/train.py benchmarks/gpu_top/job.yaml "$work"/
(
    cd "$work" && cc() { "$PY" -m clusterctl.cli "$@"; }
    cc start --dispatch job.yaml >/dev/null && sleep 12 && cc status job.yaml && COLUMNS=140 cc top --once job.yaml
    code=$?
    pid=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | head -1)
    cc stop job.yaml || code=1
    echo "after stop: trainer $pid is $(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null || echo gone) (Z: exited, not yet reaped)"
    exit $code
) || rc=1
fi

want bench && for n in 1 2; do
    part "bench: mpiexec -n $n"
    timeout 300 mpiexec -n $n "$PY" benchmarks/gpu.py bench ${BENCH_ARGS:-} || rc=1
done

if [ -n "${CUDA_MPI:-}" ] && { want cuda-mpi || want cuda-mpi-probe; }; then
    # Open MPI built with CUDA: mpi4py loads its libmpi; mpirun may run as root on a lent machine.
    CUDA_AWARE_OVERRIDE=CLUSTERCTL_COLLECTIVE_CUDA_AWARE=1
    ompi=(env PATH="$CUDA_MPI/bin:$PATH" LD_LIBRARY_PATH="$CUDA_MPI/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
          MPI4PY_LIBMPI="$CUDA_MPI/lib/libmpi.so.40" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
          OMPI_MCA_rmaps_base_oversubscribe=1 "$CUDA_MPI/bin/mpirun" --bind-to none)
    part "CUDA-aware MPI: $("$CUDA_MPI/bin/ompi_info" --parsable --all 2>/dev/null | grep -m1 'mpi_built_with_cuda_support:value')"
    for calls in Allreduce,Bcast,Ibcast Iallreduce; do
        timeout 60 "${ompi[@]}" -n 2 "$PY" benchmarks/gpu.py cuda-mpi-probe --calls $calls 2>&1 | tr -d "\\000" | grep -avE "^\s*$" | head -12
        echo "(mpirun exit ${PIPESTATUS[0]})"
    done
    # what clusterctl did before it asked who the vendor is: the device pointer straight to MPI_Iallreduce
    echo "-- the GPU tests with $CUDA_AWARE_OVERRIDE (device buffers straight to the non-blocking collectives):"
    timeout 120 env "$CUDA_AWARE_OVERRIDE" "${ompi[@]}" -n 2 "$PY" -m pytest -q -x -p no:cacheprovider \
        tests/collective/mpi_cases.py -k "cuda and not cupy" 2>&1 | tr -d "\\000" | grep -aE "passed|failed|Segmentation|signal|error" | head -6
    echo "(mpirun exit ${PIPESTATUS[0]})"
fi
if [ -n "${CUDA_MPI:-}" ] && want cuda-mpi; then
    for n in 1 2; do
        part "collective GPU tests under the CUDA-aware MPI: mpirun -n $n"
        timeout 300 "${ompi[@]}" -n $n "$PY" -m pytest -q -rs -p no:cacheprovider tests/collective/mpi_cases.py \
            -k "cuda or cupy" 2>&1 | grep -vE "durations|^$|^[0-9.]+s (call|setup|teardown)"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
    part "bench under the CUDA-aware MPI: mpirun -n 2"
    timeout 300 "${ompi[@]}" -n 2 "$PY" benchmarks/gpu.py bench ${BENCH_ARGS:-} || rc=1
fi
echo
echo "gpu_check: exit $rc"
exit $rc
