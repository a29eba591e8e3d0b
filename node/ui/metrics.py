"""Prometheus metrics on 127.0.0.1:`metrics.port`, refreshed from the node's status snapshot.

One private registry per node (tests run several nodes in one process).
Counters mirror the ledger-backed totals in NodeStatus, so they restart from
the durable numbers after a restart instead of from zero.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from murmur.node.status import DROP_REASONS, NodeStatus


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.peers = Gauge("murmur_peers", "connected peers", registry=r)
        self.version = Gauge("murmur_lineage_version", "held version per lineage", ["lineage", "relation"], registry=r)
        self.lag = Gauge("murmur_lineage_lag", "versions behind the announced head", ["lineage"], registry=r)
        self.rollouts = Gauge("murmur_rollouts_total", "rollouts by direction/status", ["kind"], registry=r)
        self.rejected = Gauge("murmur_rollouts_rejected_total", "rejected rollouts by reason", ["reason"], registry=r)
        self.versions = Gauge("murmur_versions_total", "versions published / applied", ["kind"], registry=r)
        self.reward = Gauge("murmur_reward", "latest mean reward of local rollouts", registry=r)
        self.bytes = Gauge("murmur_bytes_total", "patch bytes moved", ["direction"], registry=r)
        self.memory = Gauge("murmur_memory_rss_bytes", "resident memory of node and worker", registry=r)
        self.budget = Gauge("murmur_memory_budget_bytes", "configured memory budget", registry=r)
        self.gen = Gauge("murmur_gen_tokens_per_second", "measured generation throughput", registry=r)
        self.spot = Gauge("murmur_spot_checks_total", "log-prob spot checks", ["result"], registry=r)
        self.swarm_gives = Gauge(
            "murmur_external_per_step",
            "what the swarm gives a trainer per step (last 20 "
            "steps): groups trained, their lineages, optimizer updates",
            ["kind"],
            registry=r,
        )
        self.used_ratio = Gauge(
            "murmur_used_over_verified", "external rollouts trained over rollouts verified", registry=r
        )
        self.heldout = Gauge("murmur_heldout_accuracy", "latest held-out greedy accuracy", registry=r)
        self.restarts = Gauge("murmur_worker_restarts_total", "worker process restarts after it died", registry=r)
        self.dropped = Gauge(
            "murmur_dropped_total",
            "items the node let go, by reason (node.status.DROP_REASONS)",
            ["reason"],
            registry=r,
        )
        self.disk = Gauge("murmur_disk_bytes", "disk used per budget", ["budget"], registry=r)
        self.disk_limit = Gauge(
            "murmur_disk_limit_bytes", "configured byte limit per budget (where it is in bytes)", ["budget"], registry=r
        )
        self.exchange = Gauge(
            "murmur_exchange_total",
            "rollout exchange counters (produced, published, withheld, "
            "received, verified, used, unsampled; groups generated, sent, trained)",
            ["kind"],
            registry=r,
        )
        self.exchange_rate = Gauge(
            "murmur_exchange_per_second", "rollout exchange rates over the last 30 s", ["kind"], registry=r
        )
        self.exchange_dropped = Gauge(
            "murmur_exchange_dropped_total", "rollout batches dropped, by reason", ["reason"], registry=r
        )
        self.producers = Gauge(
            "murmur_exchange_distinct_producers", "producers verified in the last 10 min", registry=r
        )
        self.publish_budget = Gauge(
            "murmur_exchange_publish_budget_rollouts_per_second",
            "a trainer's budget for publishing its own rollouts (the demand on its shard)",
            registry=r,
        )
        self.sample = Gauge(
            "murmur_exchange_validator_sample",
            "a validator's sample: stated fraction, floor per producer per minute, share of batches checked so far",
            ["kind"],
            registry=r,
        )
        self.shards = Gauge("murmur_exchange_shards", "rollout shards: count and subscribed", ["kind"], registry=r)
        self.task_sets = Gauge(
            "murmur_exchange_task_set_rollouts",
            "rollouts verified and used per task set (at most 64 sets, the rest as 'other')",
            ["task_set", "kind"],
            registry=r,
        )
        self.generators = Gauge(
            "murmur_exchange_task_set_generators",
            "distinct producers of a lineage's verified rollouts on a task set in the last "
            "10 min (at most 32 lineages a set)",
            ["task_set", "lineage"],
            registry=r,
        )
        self.role = Gauge(
            "murmur_role",
            "1 for each role the node holds now (trainer, follower, validator); "
            "`reason` says why (a switch replaces the series)",
            ["role", "reason"],
            registry=r,
        )
        self.role_switches = Gauge(
            "murmur_role_switches_total",
            "switches between training and generating (roles chosen by the swarm's need)",
            registry=r,
        )
        self._role_key: tuple[str, ...] = ()
        self._server: Any = None
        self.port = 0

    def serve(self, port: int) -> int:
        """Start the HTTP exporter on 127.0.0.1:port (port 0 picks one); returns the bound port."""
        server, _thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self._server = server
        self.port = int(server.server_address[1])
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def update(self, s: NodeStatus) -> None:
        self.peers.set(len(s.peers))
        reason = s.roles_reason[:120]
        key = tuple(s.roles) + (reason,)
        if key != self._role_key:  # one series per role held now, labelled with the reason
            self.role.clear()
            self._role_key = key
            for role in s.roles:
                self.role.labels(role, reason).set(1)
        self.role_switches.set(s.role_switches)
        for lin in s.lineages:
            self.version.labels(lin.lineage[:16], lin.relation).set(lin.held)
            self.lag.labels(lin.lineage[:16]).set(lin.lag)
        for kind, n in (
            ("produced", s.rollouts_produced),
            ("published", s.rollouts_published),
            ("received", s.rollouts_received),
            ("accepted", s.rollouts_accepted),
            ("used", s.rollouts_used),
        ):
            self.rollouts.labels(kind).set(n)
        for reason, n in s.rejected.items():
            self.rejected.labels(reason).set(n)
        self.versions.labels("published").set(s.versions_published)
        self.versions.labels("applied").set(s.versions_applied)
        if s.reward_now is not None:
            self.reward.set(s.reward_now)
        self.bytes.labels("up").set(s.bytes_up)
        self.bytes.labels("down").set(s.bytes_down)
        self.memory.set(s.memory_rss_mb * 2**20)
        self.budget.set(s.memory_budget_mb * 2**20)
        self.gen.set(s.gen_tokens_per_s)
        self.spot.labels("eligible").set(s.spot_eligible)
        self.spot.labels("checked").set(s.spot_checked)
        self.spot.labels("failed").set(s.spot_failed)
        self.restarts.set(s.worker_restarts)
        for kind, v in (
            ("groups", s.external_groups_per_step),
            ("lineages", s.external_lineages_per_step),
            ("updates", s.updates_per_step),
        ):
            self.swarm_gives.labels(kind).set(v)
        if s.used_over_verified is not None:
            self.used_ratio.set(s.used_over_verified)
        if s.heldout_now is not None:
            self.heldout.set(s.heldout_now)
        for reason in DROP_REASONS:  # every reason exported, zeros included, so a dashboard can alert on any
            self.dropped.labels(reason).set(s.dropped.get(reason, 0))
        x = s.exchange
        for kind in (
            "produced_rollouts",
            "published_rollouts",
            "uninformative_rollouts",
            "withheld_rollouts",
            "unsent_rollouts",
            "received_batches",
            "received_rollouts",
            "verified_batches",
            "verified_rollouts",
            "used_rollouts",
            "unsampled_batches",
            "groups_generated",
            "groups_sent",
            "groups_trained",
        ):
            self.exchange.labels(kind).set(getattr(x, kind))
        if x.publish_budget_per_s is not None:
            self.publish_budget.set(x.publish_budget_per_s)
        if x.sample_rate is not None:
            self.sample.labels("fraction").set(x.sample_fraction or 0.0)
            self.sample.labels("floor_per_min").set(x.sample_floor_per_min or 0.0)
            self.sample.labels("checked_share").set(x.sample_rate)
        for kind, v in x.rates.items():
            self.exchange_rate.labels(kind.removesuffix("_per_s")).set(v)
        for reason, n in x.dropped.items():
            self.exchange_dropped.labels(reason).set(n)
        self.producers.set(x.distinct_producers)
        self.shards.labels("count").set(x.shards)
        self.shards.labels("subscribed").set(len(x.subscribed))
        for ts, c in x.task_sets.items():
            for kind in ("verified_rollouts", "used_rollouts"):
                self.task_sets.labels(ts, kind.removesuffix("_rollouts")).set(c.get(kind, 0))
        self.generators.clear()  # a lineage that stopped generating leaves the gauge
        for ts, per in x.lineages_by_task_set.items():
            for lineage, n in per.items():
                self.generators.labels(ts, lineage).set(n)
        for d in s.disk:
            self.disk.labels(d.name).set(d.used_mb * 2**20)
            if d.limit_mb:
                self.disk_limit.labels(d.name).set(d.limit_mb * 2**20)
