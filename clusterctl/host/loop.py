"""The supervisor's event loop: sockets with a callback each, polled with a short timeout between ticks.

The coordinator link registers its listener and every connection, the peer link its connection to the
coordinator; anything else that needs a socket (the control socket, clusterctl/host/control.py) registers the
same way, and may ask to be called at every round (`on_poll`).
"""

import selectors

__all__ = ["EventLoop"]


class EventLoop:
    """selectors around a map of file object -> callback(file object)."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.tickers = []

    def register(self, fileobj, callback, events=selectors.EVENT_READ):
        """Call `callback(fileobj)` whenever `fileobj` is ready (readable, by default)."""
        self.sel.register(fileobj, events, callback)

    def modify(self, fileobj, callback, events=selectors.EVENT_READ):
        """Change what `fileobj` waits for."""
        self.sel.modify(fileobj, events, callback)

    def unregister(self, fileobj):
        """Forget `fileobj` (no error if it was not registered)."""
        try:
            self.sel.unregister(fileobj)
        except (KeyError, ValueError, OSError):
            pass

    def on_poll(self, fn):
        """Call `fn()` at the start of every poll, before it waits (the owner of a socket checks its timers and
        answers what waited on the supervisor's last round: clusterctl/host/control.py)."""
        self.tickers.append(fn)

    def poll(self, timeout):
        """Run the on_poll functions, wait up to `timeout` seconds, then run the callback of every ready file
        object."""
        for fn in self.tickers:
            fn()
        for key, _ in self.sel.select(timeout=timeout):
            if self._current(key):  # an earlier callback may have closed it (and its fd be reused)
                key.data(key.fileobj)

    def _current(self, key):
        try:
            return self.sel.get_key(key.fileobj) is key
        except (KeyError, ValueError):
            return False

    def close(self):
        """Release the selector (the registered sockets are their owners' to close)."""
        self.sel.close()
