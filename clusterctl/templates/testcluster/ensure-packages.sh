#!/bin/sh
# Install what a node needs when the base image lacks it (e.g. debian:bookworm-slim from a registry).
# The debootstrap-built base already has everything, so this is a no-op there and needs no network.
set -eu
missing=""
has() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }
has sshd || missing="$missing openssh-server"
has python3 || missing="$missing python3"
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || missing="$missing python3-venv python3-pip"
has ps || missing="$missing procps"
has ip || missing="$missing iproute2"
has rsync || missing="$missing rsync"
has ping || missing="$missing iputils-ping"
has sudo || missing="$missing sudo"
[ -e /etc/ssl/certs/ca-certificates.crt ] || missing="$missing ca-certificates"
[ -e /etc/services ] || missing="$missing netbase"
if [ -n "$missing" ]; then
    echo "clusterctl: installing:$missing"
    apt-get update
    # shellcheck disable=SC2086  # word splitting of the package list is intended
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
    rm -rf /var/lib/apt/lists/*
fi
