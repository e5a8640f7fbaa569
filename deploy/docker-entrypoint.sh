#!/bin/sh
# The kvbus image's entrypoint: `docker run kvbus serve decode ...` runs `kvbus serve decode ...`.
# Each container's replica is named after its hostname unless KVBUS_WORKER_ID says otherwise, so
# replicas scaled with `docker compose up --scale decode=3` get distinct ids, and the healthcheck
# (`kvbus health decode --worker-id "$HOSTNAME"`, another process) asks this very replica.
: "${KVBUS_WORKER_ID:=$(hostname)}"
export KVBUS_WORKER_ID
exec kvbus "$@"
