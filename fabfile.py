"""The seed's fab workflow (`fab -H ip1,ip2 start | tail-log | status | kill`) and every clusterctl
operation as a fab task: see clusterctl/fabfile.py, where the tasks live (and ship with the package: clusterctl/fab/, run by `clusterctl-fab`).
fabric.yaml beside this file names clusterctl's executor, which runs each task once for all hosts."""

from clusterctl.fabfile import dispatch, doctor, exec_, kill, provision, start, status, tail_log  # noqa: F401
