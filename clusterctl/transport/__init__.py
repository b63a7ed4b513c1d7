"""Transports: how a command reaches a host. clusterctl.remote.Remote runs commands on many hosts through one."""
