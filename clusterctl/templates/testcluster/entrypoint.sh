#!/bin/sh
# PID 1 is docker's init (--init), which reaps zombies; sshd runs as its child in the foreground.
set -eu
# Host keys are never baked into the image: each container makes its own at first start.
ssh-keygen -A >/dev/null
mkdir -p /run/sshd
exec /usr/sbin/sshd -D -e
