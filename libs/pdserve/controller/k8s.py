"""The Kubernetes actuator: a plan becomes replica counts of the prefill and decode Deployments
(and of a colocated one, when the cluster has it), set through the scale subresource with the
official ``kubernetes`` client (the optional ``controller`` extra). Dry run logs each call it
would make and makes none. The RBAC it needs is deploy/k8s/components/controller: get and patch
on ``deployments/scale`` in the namespace, nothing else.

The client is synchronous; each call runs in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from pdserve.controller.actuator import ActuationError, Actuator, Flip
from pdserve.controller.optimizer import Plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Deployments:
    namespace: str = "pdserve"
    prefill: str = "prefill"
    decode: str = "decode"
    colocated: str = ""  # empty: the cluster has no colocated Deployment


def api_client(host: str = "", kubeconfig: str = "") -> Any:
    """An ``ApiClient``: in-cluster (the pod's service account) unless ``kubeconfig`` or
    ``host`` (no credentials: a proxy such as ``kubectl proxy``) says otherwise."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ActuationError("the Kubernetes actuator needs the 'kubernetes' package: pip install "
                             "'pdserve[controller]'") from None
    if host:
        conf = client.Configuration(host=host)
        return client.ApiClient(conf)
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    config.load_incluster_config()
    return client.ApiClient()


class KubernetesActuator(Actuator):
    def __init__(self, api: Any, deployments: Deployments, dry_run: bool = False) -> None:
        from kubernetes import client

        self.apps = client.AppsV1Api(api)
        self.deployments, self.dry_run = deployments, dry_run
        self.calls: list[tuple[str, int]] = []  # (deployment, replicas) patched or, dry, logged

    def targets(self, plan: Plan) -> dict[str, int]:
        d = self.deployments
        if plan.is_colocated:
            if not d.colocated:
                raise ActuationError("kubernetes: a colocated plan needs a colocated Deployment "
                                     "(--controller-colocated-deployment); none is configured")
            return {d.prefill: 0, d.decode: 0, d.colocated: plan.num_colocated}
        out = {d.prefill: plan.num_prefill, d.decode: plan.num_decode}
        if d.colocated:
            out[d.colocated] = 0
        return out

    async def apply(self, plan: Plan) -> list[Flip]:
        changed = []
        for name, replicas in self.targets(plan).items():
            if self.dry_run:
                log.info("controller dry run: would scale", extra={"fields": {
                    "deployment": name, "replicas": replicas}})
                self.calls.append((name, replicas))
                continue
            current = await self._call("read", name, self.apps.read_namespaced_deployment_scale,
                                       name, self.deployments.namespace)
            if current.spec is not None and current.spec.replicas == replicas:
                continue
            await self._call("patch", name, self.apps.patch_namespaced_deployment_scale, name,
                             self.deployments.namespace, {"spec": {"replicas": replicas}})
            self.calls.append((name, replicas))
            changed.append(Flip(name, f"replicas={replicas}", 0))
        return changed

    async def _call(self, what: str, name: str, fn: Any, *args: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return await asyncio.to_thread(fn, *args)
        except ApiException as exc:
            raise ActuationError(f"kubernetes: {what} scale of deployment "
                                 f"{self.deployments.namespace}/{name} failed: {exc.status} "
                                 f"{exc.reason}") from None
