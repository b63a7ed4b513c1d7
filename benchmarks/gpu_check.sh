#!/usr/bin/env bash
# The GPU checks of docs/benchmarks.md ("GPU: ..."), as one script for a machine with a CUDA device and
# PyTorch (issue 23, part 6). Run from anywhere:
#
#   benchmarks/gpu_check.sh                      # with clusterctl's dependencies and the MPI wheels installed
#   WHEELS=.whl benchmarks/gpu_check.sh          # a machine with no package index: install these wheels first
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

part machine
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import sys, torch, mpi4py; from mpi4py import MPI; print('python', sys.version.split()[0], '| torch',
torch.__version__, 'CUDA', torch.version.cuda, '| mpi4py', mpi4py.__version__, '|',
MPI.Get_library_version().splitlines()[0].strip())" || rc=1
echo "mpiexec: $(command -v mpiexec)"

part "doctor: the host facts script against the driver"
"$PY" benchmarks/gpu.py facts || rc=1

part "provisioning: the gpu step (driver check, CUDA and NCCL wheels)"
timeout 300 "$PY" benchmarks/gpu.py provision || rc=1

for n in 1 2; do
    for aware in "" 0; do
        part "collective GPU tests: mpi_cases.py under mpiexec -n $n${aware:+, CLUSTERCTL_COLLECTIVE_CUDA_AWARE=$aware}"
        CLUSTERCTL_COLLECTIVE_CUDA_AWARE=$aware timeout 300 mpiexec -n $n "$PY" -m pytest -q -rs -p no:cacheprovider \
            tests/collective/mpi_cases.py -k "cuda or cupy" 2>&1 | grep -vE "durations|^$|^[0-9.]+s (call|setup|teardown)"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
done

part "NCCL: two ranks on one GPU"
timeout 120 mpiexec -n 2 "$PY" benchmarks/gpu.py nccl-probe 2>&1 | grep -E "^rank|Error" | head -4

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

for n in 1 2; do
    part "bench: mpiexec -n $n"
    timeout 300 mpiexec -n $n "$PY" benchmarks/gpu.py bench ${BENCH_ARGS:-} || rc=1
done
echo
echo "gpu_check: exit $rc"
exit $rc
