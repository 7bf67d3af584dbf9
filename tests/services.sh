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
}
