#!/usr/bin/env bash
# Runs every test: starts the services the suites need (Postgres, RabbitMQ and
# the Kafka-protocol broker tansu, installing tansu once if it is missing, and
# PgBouncer from Debian's packages) when
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
ensure_pgbouncer
ensure_deploy_tools

rows="${CARGO_TARGET_DIR:-target}/tmp/correctness"
rm -rf "$rows"
status=0
cargo test --workspace "$@" || status=$?

# The correctness suites leave one row per scenario behind; show them together.
if compgen -G "$rows/*.row" >/dev/null; then
  echo
  echo "correctness summary (dups/bound: duplicates against the scenario's stated bound)"
  echo "scenario                                     committed  delivered  lost unexpected dups/bound inversions duration"
  sort "$rows"/*.row
fi
exit "$status"
