#!/usr/bin/env bash
# One hot key beside N replicas: prints what it cost Postgres (every
# postgres process's utime + stime).
#
#   bash tests/bench/hot-key.sh RELAY_BINARY REPLICAS [ROWS]
#   bash tests/bench/hot-key.sh RELAY_BINARY REPLICAS --stream RATE SECONDS
#
# The first form drains a backlog: ROWS (default 100,000) rows of 1 KiB,
# all of ordering key 'hot', and prints how long the drain took. With 2
# replicas, one owns the key's partition and drains it; the other owns the
# remaining partitions and has nothing to do, which is what this measures:
# a replica that walked the hot key's rows at every poll doubled Postgres's
# CPU (docs/benchmarks.md, "A replica beside another's hot key").
#
# The second form writes a steady stream of the hot key instead, RATE rows a
# second for SECONDS from 4 pgbench clients, while a REPEATABLE READ
# snapshot is held open (no deleted row's index entry can be marked dead),
# and prints the relays' CPU too and the entries of the fresh index read per
# row written: what the replica with nothing to do reads of the other's
# stream.
#
# The rows go to RabbitMQ's default exchange and a queue `hotq` capped at
# 1,000 messages. Uses the local Postgres (database `test`, schema
# `hotprobe`, dropped first) and RabbitMQ, python3 with pika, and pgbench.
set -euo pipefail
relay=$1
replicas=$2
rows=${3:-100000}
stream_rate= stream_s=
if [ "${3:-}" = --stream ]; then
  stream_rate=$4 stream_s=$5 rows=0
fi
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
insert="INSERT INTO hotprobe.messages (message_id, destination, ordering_key, routing_key, payload)
  SELECT gen_random_uuid(), '', 'hot', 'hotq', convert_to(repeat('x', 1024), 'UTF8')"
psql_test -c "$insert FROM generate_series(1, $rows)" >/dev/null
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

pids=()
start_relays() {
  local i
  for i in $(seq 1 "$replicas"); do
    "$relay" run >"/tmp/hot-key-relay.$i.log" 2>&1 &
    pids+=($!)
  done
}
relay_ticks() { local t=0 p; for p in "${pids[@]}"; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat"))); done; echo "$t"; }
hz=$(getconf CLK_TCK)

if [ -n "$stream_rate" ]; then
  start_relays
  sleep 3 # the replicas have taken their partitions
  PGAPPNAME=hot-key-pin psql_test -c "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class; SELECT pg_sleep($stream_s + 60)" >/dev/null 2>&1 &
  pin=$!
  sleep 1
  fresh() { psql_test -c "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE schemaname = 'hotprobe' AND indexrelname = 'messages_fresh'"; }
  script=$(mktemp)
  echo "$insert;" >"$script"
  read0=$(fresh) relay0=$(relay_ticks)
  sample
  before=$(total)
  pgbench -h 127.0.0.1 -U postgres -n -c 4 -j 2 -R "$stream_rate" -T "$stream_s" -f "$script" test >"$script.log" 2>&1
  sleep 3 # the last rows go out, and backends report their counts
  sample
  relay1=$(relay_ticks)
  sleep 1
  read1=$(fresh)
  written=$(awk '/transactions actually processed/ {split($NF, a, "/"); print a[1]}' "$script.log")
  left=$(psql_test -c "SELECT count(*) FROM hotprobe.messages")
  kill -TERM "${pids[@]}"
  wait "${pids[@]}" || true
  psql_test -c "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE application_name = 'hot-key-pin'" >/dev/null
  wait "$pin" || true
  rm -f "$script" "$script.log"
  echo "replicas=$replicas rate=$stream_rate written=$written left=$left" \
       "postgres_cpu_s=$(echo "scale=2; ($(total) - $before) / $hz" | bc)" \
       "relay_cpu_s=$(echo "scale=2; ($relay1 - $relay0) / $hz" | bc)" \
       "fresh_reads_per_row=$(echo "scale=1; ($read1 - $read0) / $written" | bc)"
  exit 0
fi

sample
before=$(total)
start_relays
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
     "postgres_cpu_s=$(echo "scale=2; ($(total) - $before) / $hz" | bc)"
