"""The supervisor's event loop: sockets with a callback each, polled with a short timeout between ticks.

The coordinator link registers its listener and every connection, the peer link its connection to the
coordinator; anything else that needs a socket (a control socket, say) registers the same way.
"""

import selectors

__all__ = ["EventLoop"]


class EventLoop:
    """selectors around a map of file object -> callback(file object)."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()

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

    def poll(self, timeout):
        """Wait up to `timeout` seconds, then run the callback of every ready file object."""
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
