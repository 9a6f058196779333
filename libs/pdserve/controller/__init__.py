"""The P:D controller (DOPD-style): monitor → predict → optimize → act.

    monitor.py    engine Stats time series and rates, the router's latency observations
    predictor.py  arrival rate and length mix over sliding windows, Holt's trend forecast
    capacity.py   per-instance prefill/decode capacity fitted from measurements (least squares)
    optimizer.py  the (prefill, decode) split or colocated that maximizes goodput under SLOs,
                  with hysteresis and a minimum dwell time
    actuator.py   the in-place actuator (Drain → SetRole on flex engines) and a dry run
    k8s.py        the Kubernetes actuator (scales the prefill and decode Deployments)
    lease.py      leader election over a Redis lease (one acting controller among routers)
    loop.py       the control loop, its log lines and Prometheus metrics

docs/controller.md describes the whole; ``pdserve sim`` (pdserve_bench.sim) evaluates it.
"""
