//! The SQL text of the claim and the settle, built once per schema. The
//! claim's shape (the head-of-key rule, the fresh and retry paths, the byte
//! limit) is explained in the parent module.

use outbox_client::SchemaName;

use super::Queries;

/// The WAL's insert and flush positions, as the claim reads them for
/// `Claimed::flushed`. A server may refuse them (Aurora has been reported
/// to refuse functions of this family; an administrator may revoke them):
/// its sessions then prepare the claim with `NULL` in their place, and
/// every batch waits for the barrier.
pub(super) const WAL_INSERTED: &str = "pg_current_wal_insert_lsn()";
pub(super) const WAL_FLUSHED: &str = "pg_current_wal_flush_lsn()";

/// A row's header bytes, as the relay counts them once it has read the row
/// (`Envelope::bytes`: names and values, as they travel), known without
/// reading the row into the relay.
///
/// Headers stored uncompressed: their stored size, which is the names and
/// values unescaped plus a few bytes per pair, less the 5 bytes an empty
/// object takes, so that a row without headers counts its payload alone.
/// Headers stored compressed (only headers of kilobytes are: Postgres
/// compresses a row's largest values first once it is over 2 KB, and 150 MB
/// of one letter fits in 2 MB) are decompressed in the server and summed
/// pair by pair. Their JSON text is no measure: a control character prints
/// as `\u0001`, six bytes for the one that travels, and a row with 45 KB of
/// them, well within RabbitMQ's frame, was refused unread as 270 KB
/// (`amqp_e2e::a_header_of_control_characters_is_sized_as_sent_not_as_printed`).
/// A value that is not a string (rows written by hand) travels as its JSON
/// text. The table's check keeps `headers` an object.
pub const HEADER_BYTES: &str = "coalesce(CASE WHEN pg_column_compression(headers) IS NULL \
     THEN greatest(pg_column_size(headers) - 5, 0) \
     ELSE (SELECT sum(octet_length(h.name) + octet_length(CASE jsonb_typeof(h.value) \
                      WHEN 'string' THEN h.value #>> '{}' ELSE h.value::text END)) \
           FROM jsonb_each(headers) AS h(name, value)) END, 0)";

impl Queries {
    /// Statements for the outbox in `schema`. With `park`, a dead-lettered
    /// message holds back the later messages of its key until it is retried or
    /// discarded; without, they go ahead. With `retain`, confirmed rows move
    /// to the `published` table with their receipts instead of being deleted.
    pub fn new(schema: &SchemaName, park: bool, retain: bool) -> Self {
        let t = format!("{}.messages", schema.quoted());
        let dl = format!("{}.dead_letters", schema.quoted());
        let pb = format!("{}.published", schema.quoted());
        let pd = format!("{}.paused_destinations", schema.quoted());
        let parked_from = if park {
            format!("(SELECT min(d.seq) AS parked_from FROM {dl} d WHERE d.ordering_key = k.key)")
        } else {
            "(SELECT NULL::bigint AS parked_from)".to_owned()
        };
        // What the verdicts need of a locked row, without its headers or
        // payload: the locking scans return each row whole otherwise, and
        // their results are kept until the union reads them.
        //
        // The sizes, so that no row is read before the relay knows it can
        // hold it (see [`HEADER_BYTES`] for the headers'). `octet_length` of
        // the payload reads its length from the TOAST pointer.
        let columns = format!(
            "seq, message_id, destination, ordering_key, routing_key, content_type, \
             event_type, created_at, attempts, octet_length(payload)::bigint AS size, \
             {HEADER_BYTES}::bigint AS headers_size, {WAL_INSERTED} AS wal_inserted"
        );
        // The rows a claim takes, by its two paths, given the parameters
        // that stand for the replica's partitions, the floor and the seqs
        // the relay's batches hold: written once for the claim's locking
        // scans and the look (`ready`), so that the look sees what the
        // claim would take.
        let fresh = |partitions: &str, floor: &str, held: &str| {
            format!(
                "next_attempt_at = '-infinity' AND partition = ANY({partitions}::smallint[]) \
                 AND seq >= {floor} AND seq NOT IN (SELECT unnest({held}::bigint[]))"
            )
        };
        let due = |partitions: &str| {
            format!(
                "next_attempt_at > '-infinity' AND next_attempt_at <= now() \
                 AND partition = ANY({partitions}::smallint[])"
            )
        };
        Queries {
            // A claim is two round trips. The first (`lock`) runs the two
            // locking scans, each bounded by the batch size: fresh rows in
            // seq order from the claim floor (see `source::floor`), and rows
            // whose own time has come (retries, and rows set aside behind
            // their key's head). Neither walks rows that are waiting, so what
            // a blocked key holds back costs nothing here, and neither walks
            // rows deleted below the floor, which an old snapshot elsewhere
            // keeps from being marked dead. It returns what the verdicts need
            // of each locked row and its small columns, not its headers or
            // payload, so the relay's next claim can start as soon as it
            // answers (the relay takes claims one at a time up to that
            // answer). `FOR UPDATE` returns each row's newest version (a row
            // another batch settled just before comes with its new
            // `attempts`).
            //
            // The relay then takes the oldest prefix of the locked rows that
            // fits the batch's row and byte limits (one row always fits), so
            // every row left out is younger than every row kept, and sends
            // three statements at once, in one round trip:
            // - `probe`, the head-of-key probes: for each key among the kept
            //   rows, the oldest row of the key below its newest kept row
            //   that is not kept (in flight elsewhere, waiting out a retry,
            //   set aside), and with parking the oldest dead letter of the
            //   key. Each statement takes a new snapshot after the rows were
            //   locked, so it sees what committed since (the transaction
            //   must be READ COMMITTED, which the relay's BEGIN says).
            // - `bodies`: the headers and payloads of the kept rows, by seq.
            //   A locked row left out by the limits is never read whole.
            // - `paused`: the paused destinations, and the transaction's
            //   `now()`, against which holds are timed.
            // The verdicts (`super::judge`) are worked out in the relay from
            // these: sorting and windowing the batch in SQL cost Postgres a
            // tenth to a third of its CPU per claim (docs/benchmarks.md,
            // "The verdicts in the relay"). The price is the second round
            // trip before a batch is published.
            //
            // The probe looks for an older row of the key in two places: at
            // or above the floor, any row; below it, where no fresh row can
            // be, only the rows that wait (their own index,
            // `messages_waiting_by_key`: `<>` in its predicate and here keeps
            // `messages_due`, whose predicate says `>`, from standing in for
            // it and reading every waiting row for each key; see migration
            // V11). It runs once per key, each branch stopping at its first
            // row, so a key with thousands of rows waiting costs two index
            // descents like any other.
            //
            // `$4` is the seqs the relay's other batches hold locked. They
            // are the oldest fresh rows, just above the floor, so the fresh
            // scan would otherwise try each one's lock and skip it, every
            // claim: up to (pipeline + 1) batches' worth of rows, which took
            // a drain's locking statement from 1.1 to 3.6 ms per 500 rows
            // (docs/benchmarks.md, "The Kafka drain ..."). Passed over by
            // seq, they cost a lookup each. A seq listed after its row was
            // released is only passed over by that claim.
            //
            // Each row also carries the WAL's insert position, read after
            // the statement's snapshot was taken, so that every commit the
            // claim sees ends below it, and before the row is locked (the
            // scan's columns are worked out below its lock): the earliest,
            // read before any row was, lies below the WAL the locks write,
            // which is flushed only with a commit (see `Claimed::flushed`).
            lock: format!(
                "WITH fresh AS ( \
                    SELECT {columns} FROM {t} WHERE {} \
                    ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED \
                 ), due AS ( \
                    SELECT {columns} FROM {t} WHERE {} \
                    ORDER BY next_attempt_at, seq LIMIT $1 FOR UPDATE SKIP LOCKED \
                 ) \
                 SELECT * FROM fresh UNION ALL SELECT * FROM due",
                fresh("$2", "$3", "$4"),
                due("$2")
            ),
            // Only keys with something found come back. A blocker's time is
            // returned only when it is finite: an in-flight fresh row's
            // '-infinity' says nothing to wait for.
            //
            // `$4` is the floor's probe seq, `$5` its scan seq, and `$6` the
            // ids of the writers the floor moved past (see
            // `source::floor::FloorAt`). While each is still in progress,
            // nothing it wrote is visible to this statement's snapshot,
            // which was taken before the check, and the probe looks from
            // `$5`: from `$4`, it walked each key's rows deleted since that
            // writer was passed, which it keeps from being marked dead.
            // `pg_xact_status` is volatile: in a subquery of its own, it is
            // asked once per statement and its answer can bound an index
            // scan.
            probe: format!(
                "WITH f AS MATERIALIZED ( \
                    SELECT CASE WHEN cardinality($6::bigint[]) > 0 AND NOT EXISTS ( \
                        SELECT FROM unnest($6::bigint[]) AS x(id) \
                        WHERE pg_xact_status(x.id::text::xid8) IS DISTINCT FROM 'in progress') \
                      THEN $5::bigint ELSE $4::bigint END AS seq \
                 ) \
                 SELECT k.key, b.seq AS gap, \
                        CASE WHEN isfinite(b.next_attempt_at) THEN b.next_attempt_at END AS gap_until, \
                        d.parked_from \
                 FROM unnest($1::text[], $2::bigint[]) AS k(key, top) \
                 LEFT JOIN LATERAL ( \
                    SELECT o.seq, o.next_attempt_at FROM ( \
                        (SELECT p.seq, p.next_attempt_at FROM {t} p \
                         WHERE p.ordering_key = k.key AND p.seq >= (SELECT seq FROM f) AND p.seq < k.top \
                           AND p.seq NOT IN (SELECT unnest($3::bigint[])) \
                         ORDER BY p.seq LIMIT 1) \
                        UNION ALL \
                        (SELECT p.seq, p.next_attempt_at FROM {t} p \
                         WHERE p.ordering_key = k.key AND p.seq < least((SELECT seq FROM f), k.top) \
                           AND p.next_attempt_at <> '-infinity' \
                           AND p.seq NOT IN (SELECT unnest($3::bigint[])) \
                         ORDER BY p.seq LIMIT 1)) o \
                    ORDER BY o.seq LIMIT 1) b ON true \
                 CROSS JOIN LATERAL {parked_from} d \
                 WHERE b.seq IS NOT NULL OR d.parked_from IS NOT NULL"
            ),
            // Whether a claim would find anything, asked outside any
            // transaction in place of a claim after one that found nothing:
            // an idle poll is then one statement and one round trip, where
            // a claim is BEGIN, the claim and a ROLLBACK. Each branch is one
            // of the locking scans' conditions, stopped at its first row. It locks
            // nothing: a row lock would give the statement a transaction
            // id, and its commit would wait for the WAL flush and for any
            // synchronous standby (a standby gone missing left every idle
            // worker waiting there). So rows are passed over as the claim
            // passes over them only when the relay's own batches hold them
            // (`$3`, by seq); rows another replica holds are seen, and the
            // claim that follows finds nothing. The guard locks no row (its
            // limit stops it first), but its `FOR UPDATE` makes the look
            // fail as a claim would on a server that takes no writes (a
            // standby after a failover, `default_transaction_read_only`),
            // so a relay left there reconnects rather than finding nothing
            // there for good.
            ready: format!(
                "WITH guard AS (SELECT FROM {t} LIMIT 0 FOR UPDATE) \
                 SELECT NOT EXISTS (SELECT FROM guard) AND ( \
                    EXISTS (SELECT FROM {t} WHERE {}) \
                    OR EXISTS (SELECT FROM {t} WHERE {} \
                               AND seq NOT IN (SELECT unnest($3::bigint[])))) AS ready",
                fresh("$1", "$2", "$3"),
                due("$1")
            ),
            // In seq order, as the kept rows are: the index gives that order.
            bodies: format!(
                "SELECT seq, headers, payload FROM {t} WHERE seq = ANY($1::bigint[]) ORDER BY seq"
            ),
            // With the WAL's flush position, for `Claimed::flushed`.
            // And the seq sequence's storage file, which `TRUNCATE ...
            // RESTART IDENTITY` replaces: see `Claimed::stale_floor`.
            paused: format!(
                "SELECT now() AS now, ARRAY(SELECT destination FROM {pd}) AS paused, \
                        {WAL_FLUSHED} AS wal_flushed, \
                        current_setting('synchronous_standby_names') = '' AS no_sync_standby, \
                        pg_relation_filenode(pg_get_serial_sequence('{lit}', 'seq')::regclass)::bigint \
                          AS seq_file",
                lit = t.replace('\'', "''")
            ),
            hold: keep_behind(
                &t,
                &format!(
                    "UPDATE {t} AS m SET next_attempt_at = u.until \
                     FROM unnest($1::bigint[], $2::timestamptz[]) AS u(seq, until) \
                     WHERE m.seq = u.seq AND m.next_attempt_at < u.until"
                ),
            ),
            dead_letter: format!(
                "WITH f AS (SELECT * FROM unnest($1::bigint[], $2::text[]) AS f(seq, err)), \
                 moved AS (DELETE FROM {t} m USING f WHERE m.seq = f.seq RETURNING m.*, f.err) \
                 INSERT INTO {dl} (seq, message_id, destination, ordering_key, routing_key, headers, \
                                   payload, content_type, event_type, created_at, attempts, last_error, last_attempt_at) \
                 SELECT seq, message_id, destination, ordering_key, routing_key, headers, payload, \
                        content_type, event_type, created_at, attempts + 1, err, now() FROM moved"
            ),
            delete: format!("DELETE FROM {t} WHERE seq = ANY($1)"),
            fail: keep_behind(
                &t,
                &format!(
                    "UPDATE {t} AS m SET attempts = m.attempts + 1, last_error = u.err, \
                        last_attempt_at = statement_timestamp(), \
                        next_attempt_at = statement_timestamp() + make_interval(secs => u.delay) \
                     FROM unnest($1::bigint[], $2::text[], $3::float8[]) AS u(seq, err, delay) \
                     WHERE m.seq = u.seq"
                ),
            ),
            note_batch_error: keep_behind(
                &t,
                &format!(
                    "UPDATE {t} AS m SET last_error = $2, last_attempt_at = now(), \
                        next_attempt_at = CASE WHEN $3::float8 IS NULL THEN next_attempt_at \
                            ELSE greatest(next_attempt_at, \
                                          statement_timestamp() + make_interval(secs => $3)) END \
                     WHERE m.seq = ANY($1)"
                ),
            ),
            // Names the newest column, so a schema a migration behind is refused
            // at start-up rather than at the first claim.
            exists: format!("SELECT event_type FROM {t} LIMIT 0"),
            // statement_timestamp(): when the settle ran, after the confirms
            // arrived (now() would be the claim's time, before publishing).
            // A kept row under the same seq is from before the sequence was
            // set back (`TRUNCATE ... RESTART IDENTITY`, `setval`): the
            // newer row replaces it, or the settle would fail, roll back,
            // and its batch go out again at every claim. It is deleted
            // (`stale`) rather than updated by ON CONFLICT, which Postgres
            // checks against UPDATE rights at every call, and roles.sql's
            // relay role has none on `published`. The one-time filter on
            // `stale` runs its delete whole before the first row is inserted.
            retain: retain.then(|| {
                format!(
                    "WITH r AS (SELECT * FROM unnest($1::bigint[], $2::text[]) AS r(seq, receipt)), \
                     moved AS (DELETE FROM {t} m USING r WHERE m.seq = r.seq RETURNING m.*, r.receipt), \
                     stale AS (DELETE FROM {pb} p USING moved WHERE p.seq = moved.seq RETURNING 1) \
                     INSERT INTO {pb} (seq, message_id, destination, ordering_key, routing_key, headers, \
                                       payload, content_type, event_type, created_at, attempts, published_at, receipt) \
                     SELECT seq, message_id, destination, ordering_key, routing_key, headers, payload, \
                            content_type, event_type, created_at, attempts, statement_timestamp(), receipt::jsonb \
                     FROM moved \
                     WHERE (SELECT count(*) FROM stale) >= 0"
                )
            }),
            // One replica cleans at a time (the others delete nothing and
            // try again at their next interval), rather than queueing on
            // each other's rows. Not `FOR UPDATE SKIP LOCKED`: a row lock
            // needs UPDATE rights, which roles.sql's relay role has not on
            // `published`, and every pass failed. The schema name is
            // checked to [a-z0-9_] and may stand in a literal.
            purge: format!(
                "WITH gate AS (SELECT pg_try_advisory_xact_lock( \
                     hashtextextended('outbox-retention:{name}', 0)) AS ok) \
                 DELETE FROM {pb} WHERE (SELECT ok FROM gate) AND seq IN ( \
                    SELECT seq FROM {pb} WHERE published_at < now() - make_interval(secs => $1) \
                    ORDER BY published_at LIMIT $2)",
                name = schema.as_str()
            ),
        }
    }
}

/// `update` (which sets new times on the rows whose seqs are `$1`), then
/// the same time on the rows waiting behind each of them that would come
/// due sooner: later rows of its key already set aside (waiting out an
/// earlier time behind it). Returns how many rows `update` changed.
///
/// Left as they were, those rows would come due before the row they wait
/// for, and the claim's scan of due rows, which goes in order of time,
/// would take them first: each blocked, they crowd the rows of other keys
/// out of a claim (CHANGELOG.md: after a Kafka partition's outage, a hot
/// key drained a few rows per batch and every other key waited). Rows
/// another transaction holds (claimed, in flight) are skipped; rows not
/// yet set aside (fresh) wait for the claim to set them aside behind the
/// row, as always.
fn keep_behind(table: &str, update: &str) -> String {
    format!(
        "WITH b AS ({update} RETURNING m.ordering_key, m.seq, m.next_attempt_at), \
         k AS (SELECT ordering_key AS key, min(seq) AS head, max(next_attempt_at) AS until \
               FROM b WHERE ordering_key IS NOT NULL AND next_attempt_at > '-infinity' \
               GROUP BY ordering_key), \
         behind AS (SELECT w.seq, k.until FROM k CROSS JOIN LATERAL ( \
               SELECT f.seq FROM {table} f \
               WHERE f.ordering_key = k.key AND f.seq > k.head \
                 AND f.next_attempt_at <> '-infinity' AND f.next_attempt_at < k.until \
                 AND f.seq <> ALL($1::bigint[]) \
               FOR UPDATE SKIP LOCKED) w), \
         pushed AS (UPDATE {table} AS m SET next_attempt_at = behind.until \
               FROM behind WHERE m.seq = behind.seq) \
         SELECT count(*) FROM b"
    )
}
