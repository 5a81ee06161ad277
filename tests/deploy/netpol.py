"""A small evaluator of Kubernetes ingress NetworkPolicies, for asserting who may reach
what in the rendered chart (pod-to-pod traffic only; ipBlock peers never match a pod)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    labels: dict[str, str]
    namespace: str
    namespace_labels: dict[str, str] = field(default_factory=dict)


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); ``{}`` matches everything."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], source: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False
    ns_selector = peer.get("namespaceSelector")
    if ns_selector is None:
        in_namespace = source.namespace == policy_namespace
    else:
        in_namespace = selector_matches(ns_selector, source.namespace_labels)
    pod_selector = peer.get("podSelector")
    return in_namespace and (pod_selector is None or selector_matches(pod_selector, source.labels))


def _port_matches(rule_port: dict[str, Any], port: int) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    if "port" not in rule_port:
        return True
    first = rule_port["port"]
    if not isinstance(first, int):
        raise AssertionError(f"named port {first!r}: the evaluator takes numbers only")
    return first <= port <= rule_port.get("endPort", first)


def _rule_allows(rule: dict[str, Any], source: Pod, port: int, namespace: str) -> bool:
    peers = rule.get("from")
    ports = rule.get("ports")
    from_ok = not peers or any(_peer_matches(p, source, namespace) for p in peers)
    port_ok = not ports or any(_port_matches(p, port) for p in ports)
    return from_ok and port_ok


def ingress_allowed(policies: list[dict], destination: Pod, source: Pod, port: int) -> bool:
    """Whether TCP from ``source`` to ``destination``'s ``port`` is let in."""
    selecting = [p for p in policies
                 if p["metadata"].get("namespace", destination.namespace) == destination.namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selector_matches(p["spec"]["podSelector"], destination.labels)]
    if not selecting:
        return True  # a pod no policy selects is not isolated
    return any(_rule_allows(rule, source, port, destination.namespace)
               for p in selecting for rule in p["spec"].get("ingress", []))
