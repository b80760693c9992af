"""Fixtures: daemon (see the module that fills this in)."""
