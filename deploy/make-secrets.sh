#!/bin/sh
# Credentials for a pdserve deployment (docs/security.md), one random value per file in
# deploy/secrets/ (mode 0600): data, admin, client, cache-salt, redis-password, and keys (the
# gateway's API keys file, one key for tenant "default"). Keeps what exists. Then:
#   Kubernetes: kubectl -n pdserve create secret generic pdserve-secrets \
#                 --from-file=deploy/secrets/data --from-file=deploy/secrets/admin \
#                 --from-file=deploy/secrets/client --from-file=deploy/secrets/cache-salt \
#                 --from-file=deploy/secrets/redis-password
#               kubectl -n pdserve create secret generic pdserve-api-keys \
#                 --from-file=keys=deploy/secrets/keys
#   compose:    deploy/compose/.env gets the Redis password and the uid that owns the files
#               (compose reads it from there; the services run as that uid).
set -eu
cd "$(dirname "$0")"
umask 077
mkdir -p secrets
token() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
for name in data admin client cache-salt redis-password; do
  [ -s "secrets/$name" ] || token > "secrets/$name"
done
[ -s secrets/keys ] || echo "sk-$(token),default" > secrets/keys
printf 'PDSERVE_REDIS_PASSWORD=%s\nPDSERVE_UID=%s\n' "$(cat secrets/redis-password)" "$(id -u)" \
  > compose/.env
echo "pdserve secrets in $(pwd)/secrets; API key: $(cut -d, -f1 secrets/keys)"
