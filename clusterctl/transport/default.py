"""Which transport a session uses when the code that builds it names none: one place, settable.

Sessions are built in a few places (clusterctl.ops.open_session, the backends, the Slurm helpers), each
taking a `transport=` argument; the command-line front ends pass none. Then `Remote` asks `transport_for`
here, and without a `factory` set, it picks the OpenSSH client (or paramiko) itself. A test that runs the
real commands against fake hosts sets `factory` (with pytest: `monkeypatch.setattr(default, "factory",
...)`, undone after the test), or wraps its code in `with use(transport):`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from .base import SshOptions, Transport
from .host import Host

__all__ = ["factory", "transport_for", "use", "Factory"]

Factory = Callable[[tuple[Host, ...], SshOptions], "Transport | None"]

#: (hosts, options) -> the Transport of a session that named none; None (or a None result): the default
factory: Factory | None = None


def transport_for(hosts: Sequence[Host], options: SshOptions) -> Transport | None:
    """The transport the factory gives a session to `hosts`; None when no factory is set."""
    made = None if factory is None else factory(tuple(hosts), options)
    if made is not None and not isinstance(made, Transport):
        raise TypeError(f"the transport factory gave a {type(made).__name__}, not a clusterctl Transport")
    return made


@contextmanager
def use(transport: "Transport | Factory") -> Iterator[None]:
    """Within the block, every session that names no transport gets `transport` (or, given a factory,
    what it returns for the session's hosts and options)."""
    global factory
    previous = factory
    factory = transport if callable(transport) and not isinstance(transport, Transport) else (lambda _h, _o: transport)
    try:
        yield
    finally:
        factory = previous
