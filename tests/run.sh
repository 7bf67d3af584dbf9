#!/usr/bin/env bash
# Runs every test: starts the services the suites need when they are not already
# up, then `cargo test --workspace`. Extra arguments go to cargo test.
#
#   bash tests/run.sh                 # everything
#   bash tests/run.sh --test client   # one suite
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/services.sh

start_postgres
start_rabbitmq

cargo test --workspace "$@"
