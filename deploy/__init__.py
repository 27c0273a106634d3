"""Deployment: Dockerfile support, docker-compose stack, Prometheus, Grafana, Kubernetes.

Python here is tooling only (not installed with the server): ``deploy.dashboard``
generates the Grafana dashboard JSON. Its PromQL is checked by Prometheus' own
``promtool`` in the tests (parsed, and evaluated over the server's real series).
"""
