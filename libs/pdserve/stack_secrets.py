"""The credentials of one stack, ``pdserve up`` or the namespace cluster (docs/security.md).

Each credential is taken from the launcher's own environment (``PDSERVE_SECRET`` or
``PDSERVE_SECRET_FILE``...) or made fresh, random, for this stack; so is the private Redis's
password. Each process gets only the ones its role needs, in its environment (never on a
command line, which ``ps`` shows to every user):

    kvd       data                          + REDIS_URL (with the password)
    engines   data, admin                   + REDIS_URL
    router    data, admin, client           + REDIS_URL
    gateway   client, cache salt

They are also written, one file each (mode 0600, in a 0700 directory removed with the stack),
for the operator: ``<dir>/PDSERVE_CLIENT_SECRET`` is what a gRPC client of the router needs.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

from pdserve import env

DATA, ADMIN = env.SECRET_VAR, env.ADMIN_SECRET_VAR
CLIENT, SALT = env.CLIENT_SECRET_VAR, env.CACHE_SALT_SECRET_VAR
NEEDS: dict[str, tuple[str, ...]] = {
    "kvd": (DATA,),
    "prefill": (DATA, ADMIN),
    "decode": (DATA, ADMIN),
    "router": (DATA, ADMIN, CLIENT),
    "gateway": (CLIENT, SALT),
}
USES_REDIS = frozenset({"kvd", "prefill", "decode", "router"})


class StackSecrets:
    def __init__(self, environ: Mapping[str, str]) -> None:
        self.values = {var: env.secret(var, environ) or secrets.token_urlsafe(32)
                       for var in env.SECRET_VARS}
        self.redis_password = secrets.token_urlsafe(32)
        self.redis_url = ""
        self.directory = Path(tempfile.mkdtemp(prefix="pdserve-up-"))  # mode 0700
        for var, value in self.values.items():
            path = self.directory / var
            path.write_text(value + "\n")
            path.chmod(0o600)

    def set_redis_url(self, url: str) -> None:
        """The Redis every role that uses one gets (in its environment); kept in the
        directory too (it may carry the password)."""
        self.redis_url = url
        if url:
            path = self.directory / env.REDIS_URL_VAR
            path.write_text(url + "\n")
            path.chmod(0o600)

    def private_redis_url(self, host: str, port: int) -> str:
        """The URL of the stack's own redis-server, its password in it."""
        return f"redis://:{quote(self.redis_password, safe='')}@{host}:{port}/0"

    def env_for(self, module: str, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` without any credential, plus those ``module``'s role needs."""
        out = {k: v for k, v in base.items() if not k.startswith(env.SECRET_VARS)}
        out.pop(env.REDIS_URL_VAR, None)
        out.update({var: self.values[var] for var in NEEDS[module]})
        if module in USES_REDIS and self.redis_url:
            out[env.REDIS_URL_VAR] = self.redis_url
        return out

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
