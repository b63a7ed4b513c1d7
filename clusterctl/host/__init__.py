"""The host side: what runs on each host (stdlib only; uploaded by the controller, content-addressed).

Uploaded as one directory named by a hash of all its files (clusterctl/ops/hosttools.py), under the name
``clusterctl_host``; every import inside is relative. The agent (`agent.py`, the command line, and the
modules it loads per command), the workspace apply (`hostws.py`, `wsfiles.py`, with the dispatch wire
format in `wire.py`), and doctor's fact script (`provision_host.py`, sent on stdin on its own).
"""
