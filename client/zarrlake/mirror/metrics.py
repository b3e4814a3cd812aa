"""Prometheus metrics of a mirror's passes (needs ``prometheus-client``: the ``mirror`` extra).

One :class:`MirrorMetrics` per replicator process, fed every :class:`MirrorStatus` a pass
returns (``Mirror.run(on_status=metrics.update)``) and served over HTTP (:meth:`serve`). Labels:
``repository`` (the source's id) and ``ref`` (``branch/<name>`` or ``tag/<name>``). A private
registry, so that two mirrors in one process (tests) do not collide.
"""

from __future__ import annotations

from typing import Any

from zarrlake.mirror.promoter import MirrorStatus


class MirrorMetrics:
    """Gauges of where each mirrored ref stands, counters of what the passes did."""

    def __init__(self, repository: str) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge
        except ImportError:  # pragma: no cover - depends on the installation
            raise ImportError(
                "mirror metrics need prometheus-client: pip install 'zarrlake[mirror]'"
            ) from None
        self.repository = repository
        self.registry = CollectorRegistry()
        labels = ["repository", "ref"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["repository"], registry=self.registry)

        self.lag = gauge(
            "zarrlake_mirror_lag_seconds",
            "How long the oldest source commit the mirror does not show yet has waited.",
        )
        self.behind = gauge(
            "zarrlake_mirror_commits_behind", "Source commits the mirror does not show yet."
        )
        self.missing = gauge(
            "zarrlake_mirror_missing_objects",
            "Objects the source's head needs that have not reached the destination.",
        )
        self.last_promotion = gauge(
            "zarrlake_mirror_last_promotion_timestamp_seconds",
            "When the ref last moved at the destination (Unix time; 0: not by this process).",
        )
        self.failing = gauge(
            "zarrlake_mirror_ref_failing", "1 if the last pass could not finish this ref."
        )
        self.passes = counter("zarrlake_mirror_passes_total", "Mirror passes completed.")
        self.promotions = counter(
            "zarrlake_mirror_promotions_total", "Refs moved (or deleted) at the destination."
        )
        self.copied_objects = counter(
            "zarrlake_mirror_copied_objects_total", "Objects the copier wrote."
        )
        self.copied_bytes = counter("zarrlake_mirror_copied_bytes_total", "Bytes the copier wrote.")
        self.checked_objects = counter(
            "zarrlake_mirror_checked_objects_total",
            "Objects a pass considered (not known to be at the destination yet).",
        )
        self._refs: set[str] = set()

    def update(self, status: MirrorStatus) -> None:
        """Take one pass's status; refs no longer mirrored (deleted at the source and at the
        destination) drop out."""
        repo = self.repository
        seen: set[str] = set()
        for ref in status.refs:
            label = f"{ref.kind}/{ref.name}"
            seen.add(label)
            self.lag.labels(repo, label).set(ref.seconds_behind)
            self.behind.labels(repo, label).set(ref.commits_behind)
            self.missing.labels(repo, label).set(ref.missing_objects)
            when = ref.last_promotion.timestamp() if ref.last_promotion is not None else 0.0
            self.last_promotion.labels(repo, label).set(when)
            self.failing.labels(repo, label).set(1 if ref.error else 0)
        for gone in self._refs - seen:
            for metric in (self.lag, self.behind, self.missing, self.last_promotion, self.failing):
                metric.remove(repo, gone)
        self._refs = seen
        self.passes.labels(repo).inc()
        self.promotions.labels(repo).inc(len(status.promoted))
        self.copied_objects.labels(repo).inc(status.copied_objects)
        self.copied_bytes.labels(repo).inc(status.copied_bytes)
        self.checked_objects.labels(repo).inc(status.checked_objects)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``port`` from a background thread."""
        from prometheus_client import start_http_server

        start_http_server(port, addr=addr, registry=self.registry)
