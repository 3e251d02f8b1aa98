"""The routing simulator: replay a trace or a coding-agent workload on N simulated
replicas whose caches are kvstore's production tier manager, routed by several policies,
and compare hit rates, hit-rate spread and TTFT (`python -m bench.sim --help`); and, for a
measured bench.fleet run, closed-loop sessions on simulated vLLM engines — their own
prefix caches, scheduler and steps — with kvstore's daemons behind them where a stack has
them (closed_loop.py, used by bench/fleet_sim.py)."""
