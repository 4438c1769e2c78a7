#!/usr/bin/env bash
# Start, stop or query the project's own Kafka broker (jars from Maven Central, no Docker).
# `scripts/kafka.sh start` prints the bootstrap address on stdout; progress goes to stderr.
set -euo pipefail
exec python -m flashrecovery.cli broker "$@"
