"""Fixtures: mp (see the module that fills this in)."""
