"""Fixtures: s3 (see the module that fills this in)."""
