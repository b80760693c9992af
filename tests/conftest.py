"""Test-wide fixtures live in fixtures_*.py beside this file."""

pytest_plugins = ["fixtures_daemon", "fixtures_etcd", "fixtures_mp", "fixtures_s3"]
