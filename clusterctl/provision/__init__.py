"""Provisioning: bring hosts to the state the spec's `provision` section asks for."""
