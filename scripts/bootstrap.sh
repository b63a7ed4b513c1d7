# Sourced by scripts/demo and scripts/test: installs what clusterctl needs on a fresh Debian 12 machine.
# Idempotent and quiet when everything is already there. Sets CLUSTERCTL_PY to the venv's python.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CLUSTERCTL_VENV:-$ROOT/.venv}"
APT_PACKAGES=(docker.io debootstrap rsync pdsh iperf3 openssh-client iproute2 ca-certificates)

say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

install_apt() {
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    say "installing ${missing[*]} (apt)"
    if [ "$(id -u)" != 0 ]; then echo "need root to apt-get install ${missing[*]}" >&2; exit 1; fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

start_docker() {
    docker info >/dev/null 2>&1 && return 0
    say "starting dockerd"
    mkdir -p /var/log
    (setsid dockerd >/var/log/clusterctl-dockerd.log 2>&1 &)
    for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && return 0; sleep 1; done
    echo "dockerd did not start within 60 s; see /var/log/clusterctl-dockerd.log" >&2
    exit 1
}

install_venv() {
    local stamp="$VENV/.clusterctl-stamp" want
    want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then return 0; fi
    say "creating $VENV (pip)"
    python3 -m venv "$VENV"
    local links=()
    [ -d /opt/wheels ] && links=(--find-links /opt/wheels)
    "$VENV/bin/pip" install -q --disable-pip-version-check "${links[@]}" -e "$ROOT[mpi,test]" "torch==2.13.0"
    echo "$want" >"$stamp"
}

install_apt
start_docker
install_venv
CLUSTERCTL_PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"
