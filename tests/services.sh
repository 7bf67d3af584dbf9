# Starts the local services the suites and the demo use, when they are not
# running. Sourced by tests/run.sh and .ci/run.

wait_for() { # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local i
  for ((i = 0; i < secs * 2; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.5
  done
  echo "error: $name did not come up within ${secs}s" >&2
  return 1
}

start_postgres() {
  if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    echo "starting postgresql"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start
  fi
  wait_for postgresql 60 psql -h 127.0.0.1 -U postgres -d postgres -Atc 'SELECT 1'
}

start_rabbitmq() {
  if ! rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
    echo "starting rabbitmq"
    rabbitmq-server -detached || true
    wait_for rabbitmq-node 90 rabbitmq-diagnostics -q ping
  fi
  # A node can answer ping with its app stopped (e.g. after an interrupted
  # outage test); make sure the broker itself is running.
  rabbitmqctl -q start_app >/dev/null 2>&1 || true
  wait_for rabbitmq 90 rabbitmqctl -q await_startup
  wait_for rabbitmq-port 30 bash -c 'exec 3<>/dev/tcp/127.0.0.1/5672'
  # Undo what an interrupted suite may have left behind: a memory alarm
  # (amqp_outage.rs) or a lowered message size limit (stalls/).
  rabbitmqctl -q set_vm_memory_high_watermark 0.4 >/dev/null 2>&1 || true
  rabbitmqctl -q eval 'application:set_env(rabbit, max_message_size, 134217728).' >/dev/null 2>&1 || true
}

# tansu: an Apache-2.0, Kafka-protocol broker from crates.io, run in memory.
# Built once with cargo install (several minutes) and reused afterwards.
TANSU_PORT=${TANSU_PORT:-9092}
TANSU_LOG=${TANSU_LOG:-${TMPDIR:-/tmp}/outbox-tansu.log}
STARTED_TANSU_PID=

tansu_bin() {
  command -v tansu 2>/dev/null || { [ -x "$HOME/.cargo/bin/tansu" ] && echo "$HOME/.cargo/bin/tansu"; }
}

start_tansu() {
  if bash -c "exec 3<>/dev/tcp/127.0.0.1/$TANSU_PORT" 2>/dev/null; then
    return 0 # something already serves the Kafka port; use it
  fi
  local bin
  bin=$(tansu_bin || true)
  if [ -z "$bin" ]; then
    echo "installing tansu (Kafka-protocol broker; one-time build of several minutes)"
    cargo install tansu --locked --features dynostore,postgres
    bin=$(tansu_bin)
  fi
  echo "starting tansu on 127.0.0.1:$TANSU_PORT (log: $TANSU_LOG)"
  "$bin" broker \
    --listener-url "tcp://127.0.0.1:$TANSU_PORT" \
    --advertised-listener-url "tcp://127.0.0.1:$TANSU_PORT" \
    --storage-engine memory://tansu/ >"$TANSU_LOG" 2>&1 &
  STARTED_TANSU_PID=$!
  wait_for tansu 60 bash -c "exec 3<>/dev/tcp/127.0.0.1/$TANSU_PORT"
}

stop_tansu() {
  if [ -n "$STARTED_TANSU_PID" ]; then
    kill "$STARTED_TANSU_PID" 2>/dev/null || true
    wait "$STARTED_TANSU_PID" 2>/dev/null || true
  fi
}

# The suites' independent consumers in another language (tests/consumers/).
ensure_python_consumers() {
  if ! python3 -c 'import pika, confluent_kafka, psycopg, cloudevents.core.bindings.rabbitmq' 2>/dev/null; then
    echo "installing python consumers' and producers' libraries (pika, confluent-kafka, psycopg, cloudevents)"
    python3 -m pip install --quiet --disable-pip-version-check pika confluent-kafka 'psycopg[binary]' 'cloudevents>=2.2' python-dateutil
  fi
}

# PgBouncer for the pooler suite (tests/tests/pooler.rs starts its own
# instances with their own configs); installed from Debian's packages once.
ensure_pgbouncer() {
  if [ ! -x /usr/sbin/pgbouncer ] && ! command -v pgbouncer >/dev/null 2>&1; then
    echo "installing pgbouncer (Debian package)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null
  fi
}

# The deploy files' own checkers (tests/tests/deploy.rs): promtool, taken
# out of Debian's prometheus package without installing (or starting) the
# server; kubernetes-validate (strict schemas, from PyPI); systemd-analyze.
DEPLOY_TOOLS=${OUTBOX_TEST_TOOLS:-$HOME/.cache/outbox-relay-tests}
export OUTBOX_TEST_PROMTOOL=${OUTBOX_TEST_PROMTOOL:-$DEPLOY_TOOLS/promtool}
ensure_deploy_tools() {
  if [ ! -x "$OUTBOX_TEST_PROMTOOL" ]; then
    echo "fetching promtool (from Debian's prometheus package, unpacked, not installed)"
    local work
    work=$(mktemp -d)
    (cd "$work" && apt-get download prometheus >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get download prometheus >/dev/null; })
    dpkg-deb -x "$work"/prometheus_*.deb "$work/x"
    mkdir -p "$(dirname "$OUTBOX_TEST_PROMTOOL")"
    cp "$work/x/usr/bin/promtool" "$OUTBOX_TEST_PROMTOOL"
    rm -rf "$work"
  fi
  if ! python3 -c 'import kubernetes_validate, yaml' 2>/dev/null; then
    echo "installing kubernetes-validate (PyPI)"
    python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate
  fi
  if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "installing systemd-analyze (Debian package systemd)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
  fi
}
