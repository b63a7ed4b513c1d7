"""The host side: what runs on each host (stdlib only; uploaded by the controller, content-addressed)."""
