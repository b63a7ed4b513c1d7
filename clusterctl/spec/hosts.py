"""Where the hosts are and how to reach them: the `ssh:` section and one `hosts:` entry."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..transport.host import split_jump
from .fields import Port, _jump_chain, _Model, _scalar_str, check_address, check_user, nonempty_path

__all__ = ["SshSpec", "HostSpec"]


class SshSpec(_Model):
    """How to reach the hosts. Keys or ssh-agent only: there is no password field.

    Unset keys (None) are left to the user's OpenSSH config, as `ssh HOST` would resolve them."""

    user: str | None = None
    port: Port | None = None
    config: str | None = None  # None: ssh's own config files; "none": no config file; else a path
    proxy_jump: tuple[str, ...] = ()  # bastions, first hop first (like `ssh -J a,b`)
    identity_file: str | None = None
    known_hosts: str | None = None  # None: what the ssh config says (default ~/.ssh/known_hosts)
    host_key_policy: Literal["strict", "accept-new", "off"] = "strict"
    connect_timeout: float = Field(10.0, gt=0, le=600, allow_inf_nan=False)
    keepalive: int = Field(15, ge=0, le=3600)
    forward_agent: bool = False
    persist: int = Field(60, ge=0, le=86400)  # seconds the OpenSSH client keeps an idle connection for reuse
    command_timeout: float = Field(60.0, gt=0, le=86400, allow_inf_nan=False)  # deadline of control commands on a host

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return None if v is None else check_user(v)

    @field_validator("proxy_jump", mode="before")
    @classmethod
    def _proxy_jump(cls, v: Any) -> Any:
        return _jump_chain(v)

    @field_validator("config", "identity_file", "known_hosts")
    @classmethod
    def _path(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.field_name != "config" and "${" in v:
            # OpenSSH reads `${NAME}` in IdentityFile and UserKnownHostsFile as an environment variable, with no way
            # to escape it (a `%` is written `%%`): the file ssh opened was another than the one named (and not the
            # one paramiko's transport opens)
            raise ValueError(f"{v!r}: ssh reads '${{...}}' in this path as an environment variable: write the path "
                             "itself")
        return nonempty_path(v)  # was taken for the key left out: another known_hosts file, say


class HostSpec(_Model):
    """One machine: where to reach it and what it offers."""

    address: str = Field(min_length=1)
    port: Port | None = None
    user: str | None = None
    proxy_jump: tuple[str, ...] | None = None  # None: ssh.proxy_jump; () ("none"): direct
    train_address: str | None = None  # what the other hosts use for this host's endpoints
    gpus: tuple[int, ...] = ()
    slots: int | None = Field(None, ge=1, le=1024)
    labels: dict[str, str] = {}
    # provisioned, dispatched and checked like the others, but runs nothing until a lost host's place needs it
    spare: bool = False

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        # `hosts: [node0, ubuntu@10.0.0.6:2222]`: an entry that is only its address, with its user and port as
        # `fab -H` takes them (an IPv6 address with a port in brackets: `[fe80::1]:2222`)
        if isinstance(data, str):
            user, address, port = split_jump(data)
            if "@" in data and not user:
                raise ValueError(f"no user before '@' in {data!r}: expected [user@]host[:port]")
            return {"address": address, **({"user": user} if user else {}), **({"port": port} if port else {})}
        if data is None or isinstance(data, (bool, int, float, list)):
            raise ValueError("expected a host address or a mapping (address:, slots:, ...)")
        return data

    @field_validator("address", "train_address")
    @classmethod
    def _address(cls, v: str | None) -> str | None:
        return None if v is None else check_address(v)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return None if v is None else check_user(v)

    @field_validator("proxy_jump", mode="before")
    @classmethod
    def _proxy_jump(cls, v: Any) -> Any:
        return None if v is None else _jump_chain(v)

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("expected a GPU count or a list of GPU indices")
        if isinstance(v, int):
            if not 0 <= v <= 1024:
                raise ValueError("GPU count must be between 0 and 1024")
            return tuple(range(v))
        if isinstance(v, list):
            if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i <= 1024 for i in v):
                raise ValueError("GPU indices must be integers between 0 and 1024")
            if len(set(v)) != len(v):
                raise ValueError("GPU indices must be distinct")
        return v

    @field_validator("labels", mode="before")
    @classmethod
    def _labels(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): _scalar_str(x) for k, x in v.items()}
        return v
