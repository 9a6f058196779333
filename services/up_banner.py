"""What ``pdserve up`` prints once its stack is ready: every address (the ports the services
bound), the logs and secrets directories, a try-it snippet, and, on request, a Prometheus scrape
config for every service's /metrics."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Protocol

from pdserve import env
from pdserve.procs import Proc
from pdserve.stack_secrets import StackSecrets


class Stack(Protocol):
    """What the banner reads of ``services.launcher.Stack`` (which imports this module)."""

    ns: argparse.Namespace
    procs: list[Proc]
    gateway: Proc
    redis_url: str
    secrets: StackSecrets
    log_dir: Path

    @property
    def router_address(self) -> str: ...


def write_prometheus_config(path: str, stack: Stack) -> None:
    """A scrape config with one job per service kind, labelled with each instance's name."""
    jobs: dict[str, list[tuple[str, str]]] = {}
    for proc in stack.procs:
        if proc.metrics:
            jobs.setdefault(proc.name.split("-")[0], []).append((proc.name, proc.metrics))
    lines = ["# pdserve up: every service's /metrics (Prometheus scrape config)",
             "scrape_configs:"]
    for job, targets in sorted(jobs.items()):
        lines += [f"  - job_name: pdserve-{job}", "    static_configs:"]
        lines += [f"      - targets: ['{t}']\n        labels: {{pdserve_name: {n}}}"
                  for n, t in targets]
    if not stack.ns.keys_file:  # with API keys, the gateway's /metrics needs one
        lines += ["  - job_name: pdserve-gateway", "    static_configs:",
                  f"      - targets: ['{stack.ns.host}:{stack.gateway.port}']"]
    Path(path).write_text("\n".join(lines) + "\n")


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


def banner(stack: Stack) -> None:
    ns = stack.ns
    model = ns.served_model_name[0] if ns.served_model_name else ns.model
    base = f"http://{ns.host}:{stack.gateway.port}/v1"
    auth = "" if ns.keys_file else "(no API keys: loopback only, without auth)"
    print(f"pdserve router: {stack.router_address}")
    print(f"pdserve redis: {_without_password(stack.redis_url) or 'none'}")
    print(f"pdserve secrets: {stack.secrets.directory}")
    print(f"pdserve logs: {stack.log_dir}")
    print("pdserve metrics: " + " ".join(f"{p.name}={p.metrics}" for p in stack.procs
                                          if p.metrics)
          + f" gateway={ns.host}:{stack.gateway.port}/metrics")
    if ns.prometheus_config:
        write_prometheus_config(ns.prometheus_config, stack)
        print(f"pdserve prometheus config: {ns.prometheus_config}")
    python = shlex.quote(sys.executable)  # the one with pdserve (and openai) installed
    print(f"""
Try it {auth}:
  curl {base}/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}'
  {python} -c "from openai import OpenAI; c = OpenAI(base_url='{base}', api_key='none'); \\
print(c.completions.create(model='{model}', prompt='Hello', max_tokens=16).choices[0].text)"
  {env.CLIENT_SECRET_VAR}_FILE={stack.secrets.directory / env.CLIENT_SECRET_VAR} \\
  {python} -c "from pdserve.client import Client; \\
print(Client('{stack.router_address}').generate('Hello', max_tokens=16).collect().text)"
""")
    print(f"pdserve ready: {base}", flush=True)
