#!/usr/bin/env bash
# Runs a command in a private network namespace whose only interface is loopback.
#
# Why: a multi-node Ray cluster on one machine needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 (without it
# `ray start --address` refuses to join), and then Ray 2.60's GCS and raylets listen on '::' and a
# dashboard agent on 0.0.0.0 whatever --node-ip-address says. Inside a namespace that has only `lo`
# those sockets are reachable from loopback alone. Needs root (CI) or unprivileged user namespaces;
# where neither works the command is not run here and the multi-node tests skip (or fail under
# OSVL_REQUIRE_NETNS=1, which `make test` sets).
set -euo pipefail
if unshare --net true 2>/dev/null; then
  exec unshare --net bash -c 'ip link set lo up && exec "$@"' bash "$@"
elif unshare --user --map-root-user --net true 2>/dev/null; then
  exec unshare --user --map-root-user --net bash -c 'ip link set lo up && exec "$@"' bash "$@"
fi
echo "netns.sh: cannot create a network namespace here; running without one" >&2
exec "$@"
