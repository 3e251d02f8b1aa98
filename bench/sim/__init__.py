"""The routing simulator: replay a trace or a coding-agent workload on N simulated
replicas whose caches are kvstore's production tier manager, routed by several policies,
and compare hit rates, hit-rate spread and TTFT (`python -m bench.sim --help`)."""
