#!/bin/sh
# PID 1 is docker's init (--init), which reaps zombies; sshd runs as its child in the foreground.
# The node's shape comes from its environment (set by `clusterctl testcluster up` with `docker run -e`):
#   CLUSTERCTL_USER=NAME         a login user NAME (uid 1000, home /home/NAME, bash); root login disabled
#   CLUSTERCTL_SUDO=nopasswd     NAME may `sudo` without a password (default)
#   CLUSTERCTL_SUDO=password     NAME's sudo asks for a random password that is never written anywhere
#   CLUSTERCTL_NO_DEFAULT_ROUTE=1  drop the default route (nodes behind a bastion; needs CAP_NET_ADMIN)
set -eu
# Host keys are never baked into the image: each container makes its own at first start.
ssh-keygen -A >/dev/null
mkdir -p /run/sshd
if [ "${CLUSTERCTL_NO_DEFAULT_ROUTE:-}" = 1 ] && ip route show default | grep -q .; then
    ip route del default
fi
user="${CLUSTERCTL_USER:-root}"
if [ "$user" = root ]; then
    exec /usr/sbin/sshd -D -e
fi
if ! id -u "$user" >/dev/null 2>&1; then
    useradd --create-home --uid 1000 --user-group --shell /bin/bash "$user"
fi
rule=/etc/sudoers.d/90-clusterctl-user
case "${CLUSTERCTL_SUDO:-nopasswd}" in
    nopasswd)
        # '*': no password can match, yet the account is not locked ('!'), which sshd without PAM refuses.
        usermod --password '*' "$user"
        printf '%s ALL=(ALL) NOPASSWD:ALL\n' "$user" >"$rule"
        chmod 0440 "$rule"
        ;;
    password)
        # In group sudo (Debian's sudoers: %sudo ALL=(ALL:ALL) ALL), so sudo asks for this password.
        rm -f "$rule"
        usermod --append --groups sudo "$user"
        secret=$(head -c 24 /dev/urandom | base64)
        printf '%s:%s\n' "$user" "$secret" | chpasswd
        unset secret
        ;;
    *)
        echo "clusterctl: unknown CLUSTERCTL_SUDO=${CLUSTERCTL_SUDO}" >&2
        exit 2
        ;;
esac
exec /usr/sbin/sshd -D -e -o PermitRootLogin=no
