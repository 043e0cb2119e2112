"""Many replicas' /metrics as one: counters and histograms summed (the deployment's totals, under the names a
single server uses, so the same queries and dashboards work), gauges kept apart by a `replica` label (one
replica's batch or queue is not the sum of all)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

SUMMED = ("counter", "histogram", "summary")


def merge_metrics(texts: dict[str, str]) -> bytes:
    """texts: each replica's exposition, by replica name. The merged exposition, in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FixedCollector(merged_families(texts)))
    return generate_latest(registry)


def merged_families(texts: dict[str, str]) -> list[Metric]:
    """The merged metric families (see merge_metrics)."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):  # a start time (read back as a gauge): one per replica is noise
                continue
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            if family.type not in SUMMED:
                merged.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value) for s in family.samples]
                continue
            totals = sums.setdefault(family.name, {})
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                totals[key] = totals.get(key, 0.0) + s.value
    for name, totals in sums.items():
        families[name].samples = [Sample(sample, dict(labels), value) for (sample, labels), value in totals.items()]
    return list(families.values())


class FixedCollector:
    """A collector that gives the families it holds (replaced as new readings come)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families
