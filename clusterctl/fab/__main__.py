"""`python -m clusterctl.fab ...`: the same as `clusterctl-fab ...`."""

from . import main

main()
