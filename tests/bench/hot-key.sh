#!/usr/bin/env bash
# One hot key drained by N replicas: prints how long the drain took and the
# CPU Postgres spent on it (every postgres process's utime + stime).
#
#   bash tests/bench/hot-key.sh RELAY_BINARY REPLICAS [ROWS]
#
# ROWS (default 100,000) rows of 1 KiB, all of ordering key 'hot', go to
# RabbitMQ's default exchange and a queue `hotq` capped at 1,000 messages.
# With 2 replicas, one owns the key's partition and drains it; the other
# owns the remaining partitions and has nothing to do, which is what this
# measures: a replica that walked the hot key's rows at every poll doubled
# Postgres's CPU (docs/benchmarks.md, "A replica beside another's hot
# key"). Uses the local Postgres (database `test`, schema `hotprobe`,
# dropped first) and RabbitMQ, and python3 with pika.
set -euo pipefail
relay=$1
replicas=$2
rows=${3:-100000}
psql_test() { psql -h 127.0.0.1 -U postgres -d test -qAt "$@"; }
export OUTBOX_DATABASE_URL=postgres://postgres@127.0.0.1:5432/test
export OUTBOX_SCHEMA=hotprobe
export OUTBOX_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f
export OUTBOX_HTTP_ADDR=127.0.0.1:0

psql_test -c "DROP SCHEMA IF EXISTS hotprobe CASCADE" >/dev/null 2>&1
"$relay" migrate >/dev/null
python3 - <<'PY'
import pika
c = pika.BlockingConnection(pika.ConnectionParameters('127.0.0.1'))
ch = c.channel()
ch.queue_delete(queue='hotq')
ch.queue_declare(queue='hotq', arguments={'x-max-length': 1000})
c.close()
PY
psql_test -c "INSERT INTO hotprobe.messages (message_id, destination, ordering_key, routing_key, payload)
  SELECT gen_random_uuid(), '', 'hot', 'hotq', convert_to(repeat('x', 1024), 'UTF8')
  FROM generate_series(1, $rows)" >/dev/null
psql_test -c "VACUUM ANALYZE hotprobe.messages" >/dev/null

# Each postgres process's CPU ticks as last seen: a backend that ends keeps
# what it had at the last sample.
declare -A ticks
sample() {
  local p st
  for p in $(pgrep -x postgres); do
    st=$(cat "/proc/$p/stat" 2>/dev/null) || continue
    ticks[$p]=$(awk '{print $14 + $15}' <<<"$st")
  done
}
total() { local t=0 p; for p in "${!ticks[@]}"; do t=$((t + ticks[$p])); done; echo "$t"; }

sample
before=$(total)
pids=()
for i in $(seq 1 "$replicas"); do
  "$relay" run >"/tmp/hot-key-relay.$i.log" 2>&1 &
  pids+=($!)
done
started=$(date +%s.%N)
until [ "$(psql_test -c "SELECT count(*) FROM (SELECT FROM hotprobe.messages LIMIT 1) s")" = 0 ]; do
  sample
  sleep 0.5
done
sample
ended=$(date +%s.%N)
kill -TERM "${pids[@]}"
wait "${pids[@]}" || true
echo "replicas=$replicas rows=$rows drain_s=$(echo "$ended - $started" | bc)" \
     "postgres_cpu_s=$(echo "scale=2; ($(total) - $before) / $(getconf CLK_TCK)" | bc)"
