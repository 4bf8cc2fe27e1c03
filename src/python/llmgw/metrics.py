"""Metrics kept in memory and their Prometheus text exposition (format 0.0.4).

Counters, gauges and histograms keyed by label values; a `MetricsRegistry` renders its families
in registration order, each with its HELP and TYPE lines. Shared by the gateway, the listeners'
connection counts and the control plane's own families.

A series is named by label keywords (`inc(model="chat")`), checked against the family's labels
each time; a caller on a hot path (the gateway, per request) takes the series' key once
(`key(model="chat")`, the label values in the family's order) and counts by it (`add`,
`observe_at`), which checks nothing and allocates nothing for a series already seen.
"""

from __future__ import annotations

import bisect
import math

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _Family:
    kind = ""

    def __init__(self, name: str, help: str, labels: tuple[str, ...]) -> None:
        self.name, self.help, self.labels = name, help, labels

    def key(self, **labels: str) -> tuple[str, ...]:
        """The series' key: its label values in the family's order (`add`, `observe_at`)."""
        if len(labels) == len(self.labels):
            try:
                return tuple([str(labels[k]) for k in self.labels])
            except KeyError:
                pass
        raise ValueError(f"{self.name} takes labels {self.labels}, got {tuple(labels)}")

    def _labels(self, key: tuple[str, ...], extra: tuple[tuple[str, str], ...] = ()) -> str:
        pairs = [*zip(self.labels, key, strict=True), *extra]
        if not pairs:
            return ""
        return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"

    def lines(self) -> list[str]:
        raise NotImplementedError


class Counter(_Family):
    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()) -> None:
        super().__init__(name, help, labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.add(self.key(**labels), amount)

    def add(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        """`inc` of the series `key` (from `key`)."""
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(self.key(**labels), 0.0)

    def lines(self) -> list[str]:
        return [f"{self.name}{self._labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        self.values[self.key(**labels)] = value

    def clear(self) -> None:
        self.values.clear()


class Histogram(_Family):
    kind = "histogram"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = (), buckets=LATENCY_BUCKETS) -> None:
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets))
        self.counts: dict[tuple[str, ...], list[int]] = {}  # per bucket, not cumulative; last = +Inf
        self.sums: dict[tuple[str, ...], float] = {}

    def observe(self, value: float, **labels: str) -> None:
        self.observe_at(self.key(**labels), value)

    def observe_at(self, key: tuple[str, ...], value: float) -> None:
        """`observe` in the series `key` (from `key`)."""
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = [0] * (len(self.buckets) + 1)
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[key] = self.sums.get(key, 0.0) + value

    def set(self, counts: list[int], total: float, **labels: str) -> None:
        """Take observations counted elsewhere: `counts` per bucket (not cumulative, the last
        above every bound) and their sum."""
        if len(counts) != len(self.buckets) + 1:
            raise ValueError(f"{self.name} has {len(self.buckets) + 1} buckets, got {len(counts)} counts")
        key = self.key(**labels)
        self.counts[key] = list(counts)
        self.sums[key] = total

    def lines(self) -> list[str]:
        out = []
        for key, counts in sorted(self.counts.items()):
            total = 0
            for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
                total += count
                le = "+Inf" if bound == math.inf else _num(bound)
                out.append(f"{self.name}_bucket{self._labels(key, (('le', le),))} {total}")
            out.append(f"{self.name}_sum{self._labels(key)} {_num(self.sums[key])}")
            out.append(f"{self.name}_count{self._labels(key)} {total}")
        return out


class MetricsRegistry:
    def __init__(self) -> None:
        self.families: list[_Family] = []

    def _add(self, family):
        self.families.append(family)
        return family

    def counter(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._add(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: tuple[str, ...] = ()) -> Gauge:
        return self._add(Gauge(name, help, labels))

    def histogram(self, name: str, help: str, labels: tuple[str, ...] = (), buckets=LATENCY_BUCKETS) -> Histogram:
        return self._add(Histogram(name, help, labels, buckets))

    def render(self) -> str:
        out = []
        for f in self.families:
            out.append(f"# HELP {f.name} {f.help}")
            out.append(f"# TYPE {f.name} {f.kind}")
            out.extend(f.lines())
        return "\n".join(out) + "\n"


def merge(*texts: str) -> str:
    """Several expositions as one, as Prometheus takes them: a family more than one has appears
    once (its HELP and TYPE from the first), with the series of each, in order."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # name -> (its HELP and TYPE lines, its series)
    name = ""
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# "):
                word, name = line.split(" ", 3)[1:3]  # "HELP" or "TYPE", the family's name
                head, _ = families.setdefault(name, ([], []))
                if not any(h.split(" ", 2)[1] == word for h in head):
                    head.append(line)
            elif line:
                families.setdefault(name, ([], []))[1].append(line)
    return "".join(line + "\n" for head, series in families.values() for line in (*head, *series))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))
