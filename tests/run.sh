#!/usr/bin/env bash
# Runs every test: starts the services the suites need (Postgres, RabbitMQ and
# the Kafka-protocol broker tansu, installing tansu once if it is missing) when
# they are not already up, then `cargo test --workspace`; stops what it started. Extra arguments go to cargo test.
#
#   bash tests/run.sh                 # everything
#   bash tests/run.sh --test client   # one suite
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/services.sh

start_postgres
start_rabbitmq
start_tansu
trap stop_tansu EXIT
ensure_python_consumers

cargo test --workspace "$@"
