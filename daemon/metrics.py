"""The metrics catalogue: every Prometheus series the daemon exports.

One registry per daemon process (tests may run several daemons in one
process). Ranks never expose their own scrape target: they report through
heartbeats and captures, and the daemon turns that into these series.
Dashboards (grafana/) and alert rules refer only to names defined here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
)

STALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)
IO_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SHARD_STATES = ("healthy", "missing", "repairing")
RECOVERY_OUTCOMES = ("completed", "stopped")
RECOVERY_PHASES = ("plan", "rebuild", "restore", "restore_read")
# core.decide.PlanDecision.kind, and the coordinator's widening of a plan
PLAN_CHANGE_KINDS = ("replace", "shrink", "rebuild", "grow", "relaunch")
SCRUB_TIERS = ("ram", "disk", "local", "peer", "s3", "scrub")


@dataclass
class Metrics:
    """All series of one daemon, registered in its own registry."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        ProcessCollector(registry=r)  # daemon resource use: CPU, RSS, open fds
        # Snapshot path
        self.capture_stall = Histogram(
            "stalwart_capture_stall_seconds",
            "Time a training step was blocked by a capture, per rank.",
            ["rank"], buckets=STALL_BUCKETS, registry=r)
        self.captured_bytes = Counter(
            "stalwart_captured_bytes_total", "State bytes captured from ranks.", registry=r)
        self.stored_bytes = Counter(
            "stalwart_stored_bytes_total", "Bytes written to a storage tier (after coding).",
            ["tier"], registry=r)
        self.compression_ratio = Gauge(
            "stalwart_compression_ratio",
            "Captured bytes / encoded bytes of the last committed step.", registry=r)
        self.last_committed_step = Gauge(
            "stalwart_last_committed_step", "Newest committed step of the job.", registry=r)
        self.commits = Counter("stalwart_commits_total", "Steps committed.", registry=r)
        self.commit_tree = Counter(
            "stalwart_commit_tree_messages_total",
            "Other daemons' prepares this daemon passed up the commit tree (up), and "
            "commits it passed on to its children (down).", ["direction"], registry=r)
        self.commit_seconds = Histogram(
            "stalwart_commit_seconds", "Capture-to-commit latency of a step.",
            buckets=PHASE_BUCKETS, registry=r)
        # Erasure coding and tiers
        self.shards = Gauge(
            "stalwart_shards", "Shards known to this daemon by state.", ["state"], registry=r)
        self.protection_margin = Gauge(
            "stalwart_protection_margin_nodes",
            "How many more node losses the newest committed step survives.", registry=r)
        self.coder_bytes = Counter(
            "stalwart_coder_bytes_total", "Bytes through the erasure coder.", ["op"], registry=r)
        self.coder_seconds = Counter(
            "stalwart_coder_seconds_total", "Seconds spent in the erasure coder.", ["op"],
            registry=r)
        self.repair_pending = Gauge(
            "stalwart_repair_pending_shards", "Shards waiting to be re-created.", registry=r)
        self.repaired_shards = Counter(
            "stalwart_repaired_shards_total", "Shards re-created after a loss.", registry=r)
        self.scrub_errors = Counter(
            "stalwart_scrub_errors_total", "Checksum mismatches found by scrub or reads.",
            ["tier"], registry=r)
        self.s3_seconds = Histogram(
            "stalwart_s3_request_seconds", "S3 request latency by operation.", ["op"],
            buckets=IO_BUCKETS, registry=r)
        self.s3_errors = Counter(
            "stalwart_s3_errors_total", "S3 errors by operation and code.", ["op", "code"],
            registry=r)
        self.peer_seconds = Histogram(
            "stalwart_peer_request_seconds", "Shard transfer latency to peers.", ["op"],
            buckets=IO_BUCKETS, registry=r)
        self.peer_errors = Counter(
            "stalwart_peer_errors_total", "Failed shard transfers by peer.", ["peer", "op"],
            registry=r)
        # Detection and recovery
        self.heartbeats = Counter(
            "stalwart_heartbeats_total", "Rank heartbeats received.", registry=r)
        self.failures = Counter(
            "stalwart_failures_detected_total", "Failures detected by kind.", ["kind"],
            registry=r)
        self.recoveries = Counter(
            "stalwart_recoveries_total", "Recoveries by outcome.", ["outcome"], registry=r)
        self.recovery_phase = Histogram(
            "stalwart_recovery_phase_seconds", "Duration of each recovery phase.", ["phase"],
            buckets=PHASE_BUCKETS, registry=r)
        self.generation = Gauge("stalwart_generation", "Current generation.", registry=r)
        self.plan = Info("stalwart_plan", "Current parallel plan.", registry=r)
        self.plan_changes = Counter(
            "stalwart_plan_changes_total", "Plan changes by kind.", ["kind"], registry=r)
        self.layers_moved = Counter(
            "stalwart_layers_moved_total", "Layers moved between ranks by plan changes.",
            registry=r)
        self.ranks = Gauge("stalwart_ranks", "Registered ranks by state.", ["state"], registry=r)
        self.peers = Gauge("stalwart_peers", "Peer daemons by state.", ["state"], registry=r)
        self.step_time = Gauge(
            "stalwart_step_time_seconds", "Last reported step time per rank.", ["rank"],
            registry=r)
        self.straggler = Gauge(
            "stalwart_straggler", "1 while a rank is flagged as a straggler.", ["rank"],
            registry=r)
        self.training_step = Gauge(
            "stalwart_training_step", "Last step reported by a rank.", ["rank"], registry=r)
        self.link_bytes = Counter(
            "stalwart_link_bytes_total",
            "Bytes ranks sent by collective over intra-node or inter-node links.",
            ["link", "collective"], registry=r)
        # Security
        self.auth_refused = Counter(
            "stalwart_auth_refused_total", "Refused callers by reason.", ["reason"], registry=r)
        # Known label values show from the first scrape, at 0, so panels and alerts
        # see "none yet" instead of "no data".
        for state in SHARD_STATES:
            self.shards.labels(state)
        for outcome in RECOVERY_OUTCOMES:
            self.recoveries.labels(outcome)
        for phase in RECOVERY_PHASES:
            self.recovery_phase.labels(phase)
        for kind in PLAN_CHANGE_KINDS:
            self.plan_changes.labels(kind)
        for tier in SCRUB_TIERS:
            self.scrub_errors.labels(tier)
