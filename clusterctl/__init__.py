"""clusterctl: run distributed deep-learning training on machines reached over SSH."""

__version__ = "0.1.0"
