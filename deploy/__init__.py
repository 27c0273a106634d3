"""Deployment: Dockerfile support, docker-compose stack, Prometheus, Grafana, Kubernetes.

Python here is tooling only (not installed with the server): ``deploy.dashboard``
generates the Grafana dashboard JSON, ``deploy.promql_names`` finds the metric
names that PromQL expressions and dashboards read.
"""
