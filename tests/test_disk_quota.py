"""The local tier's disk quota refuses a step that would exceed it, naming the setting."""

from pathlib import Path

import pytest

from stalwart.daemon.config import load_config
from stalwart.daemon.config_schema import ConfigError
from stalwart.daemon.snapshot.quota import DiskQuota, QuotaExceeded


def test_a_step_past_the_quota_is_refused_with_the_setting_named(tmp_path: Path) -> None:
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    (snaps / "chunk").write_bytes(b"x" * 600)
    quota = DiskQuota([snaps, tmp_path / "shards"], limit=1000)
    quota.reserve(300)  # 900 of 1000
    with pytest.raises(QuotaExceeded, match=r"disk_quota_bytes = 1000"):
        quota.reserve(200)


def test_no_quota_means_no_limit(tmp_path: Path) -> None:
    DiskQuota([tmp_path], limit=0).reserve(10**15)


def test_the_quota_is_measured_again_after_files_go(tmp_path: Path) -> None:
    victim = tmp_path / "old-step"
    victim.write_bytes(b"x" * 900)
    quota = DiskQuota([tmp_path], limit=1000, every_s=0.0)
    with pytest.raises(QuotaExceeded):
        quota.reserve(200)
    victim.unlink()  # retention collected the old step
    quota.reserve(200)


def test_a_negative_quota_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "stalwart.toml"
    cfg.write_text("[snapshot]\ndisk_quota_bytes = -1\n")
    with pytest.raises(ConfigError, match="snapshot.disk_quota_bytes"):
        load_config(cfg, env={})
