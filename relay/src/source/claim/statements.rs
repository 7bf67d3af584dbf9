//! The SQL text of the claim and the settle, built once per schema. The
//! claim's shape (the head-of-key rule, the fresh and retry paths, the byte
//! limit) is explained in the parent module.

use outbox_client::SchemaName;

use super::Queries;

/// The transaction-local setting that carries a claim's locked seqs from
/// its first statement to its second.
const CLAIMED: &str = "outbox.claimed";

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
            format!("(SELECT min(d.seq) FROM {dl} d WHERE d.ordering_key = m.ordering_key)")
        } else {
            "NULL::bigint".to_owned()
        };
        Queries {
            // A claim is two statements, sent together. The first (`lock`)
            // runs the two locking scans, each bounded by the batch size:
            // fresh rows in seq order from the claim floor (see
            // `source::floor`), and rows whose own time has come (retries,
            // and rows set aside behind their key's head). Neither walks rows
            // that are waiting, so what a blocked key holds back costs
            // nothing here, and neither walks rows deleted below the floor,
            // which an old snapshot elsewhere keeps from being marked dead.
            // It leaves the seqs it locked in a setting local to the
            // transaction, `outbox.claimed`, and answers at once, so the
            // relay's next claim can start while this one's verdicts are
            // worked out (the relay takes claims one at a time up to that
            // answer). The second (`claim`) reads the locked rows back by seq
            // and decides each one's verdict. Its snapshot is taken after the
            // rows were locked, so it reads their newest versions (a row
            // another batch settled just before is seen with its new
            // `attempts`); the transaction must be READ COMMITTED, which the
            // relay's BEGIN says.
            //
            // The head-of-key probe looks for an older row of the key in two
            // places, for the same reason: at or above the floor, any row;
            // below it, where no fresh row can be, only the rows that wait
            // (their own index, `messages_waiting_by_key`: `<>` in its
            // predicate and here keeps `messages_due`, whose predicate says
            // `>`, from standing in for it and reading every waiting row for
            // each key; see migration V11). It runs once per
            // key, on the key's newest kept row, and window functions carry
            // what it found to the key's other rows. No step joins two of
            // these sets to each other: with no statistics (a table never
            // analyzed) the planner takes every set for one row, and such a
            // join ran the probes once per row and key.
            //
            // The window steps carry only what the verdicts need (seq,
            // destination, key, size); the rest of each row, payload
            // included, is read last, by seq, one index lookup per row
            // (`OFFSET 0` keeps the planner from turning it into a join
            // over the whole table). Carried through the window steps,
            // every sort and window copied those columns: it cost Postgres
            // about a tenth more CPU per claim (docs/benchmarks.md). A
            // large payload stays TOASTed until then, and a blocked row's
            // is not sent.
            //
            // `kept` is the oldest prefix of the locked rows that fits the
            // batch's row and byte limits (one row always fits), so every row
            // left out is younger than every row kept. A kept row is blocked
            // when its destination is paused, when an older kept row of its
            // key goes to a paused destination, when an older row of its key
            // is not kept (in flight elsewhere, waiting out a retry, set
            // aside) or, when parking, an older message of its key is
            // dead-lettered. A blocked row is returned
            // without its payload, with the time to set it aside until when
            // its blocker is waiting (nothing when the blocker is merely in
            // flight in another batch).
            lock: format!(
                "WITH fresh AS ( \
                    SELECT seq FROM {t} \
                    WHERE next_attempt_at = '-infinity' AND partition = ANY($2::smallint[]) \
                      AND seq >= $3 \
                    ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED \
                 ), due AS ( \
                    SELECT seq FROM {t} \
                    WHERE next_attempt_at > '-infinity' AND next_attempt_at <= now() \
                      AND partition = ANY($2::smallint[]) \
                    ORDER BY next_attempt_at, seq LIMIT $1 FOR UPDATE SKIP LOCKED \
                 ) \
                 SELECT set_config('{CLAIMED}', coalesce(array_agg(c.seq), '{{}}')::text, true) \
                 FROM (SELECT seq FROM fresh UNION ALL SELECT seq FROM due) c"
            ),
            claim: format!(
                "WITH locked AS ( \
                    SELECT seq, destination, ordering_key, octet_length(payload) AS size \
                    FROM {t} \
                    WHERE seq = ANY(current_setting('{CLAIMED}')::bigint[]) \
                 ), cand AS ( \
                    SELECT c.*, row_number() OVER w AS n, sum(c.size) OVER w - c.size AS before, \
                           c.destination IN (SELECT destination FROM {pd}) AS paused \
                    FROM locked c \
                    WINDOW w AS (ORDER BY c.seq) \
                 ), kept AS ( \
                    SELECT * FROM cand WHERE n <= $1 AND (n = 1 OR before + size <= $2) \
                 ), keyed AS ( \
                    SELECT c.*, max(c.seq) OVER k AS top, \
                           min(c.seq) FILTER (WHERE c.paused) OVER k AS key_paused_from \
                    FROM kept c WINDOW k AS (PARTITION BY c.ordering_key) \
                 ), probed AS ( \
                    SELECT m.*, b.seq AS gap1, b.next_attempt_at AS gap_until1, \
                           CASE WHEN m.ordering_key IS NOT NULL AND m.seq = m.top \
                                THEN {parked_from} END AS parked1 \
                    FROM keyed m LEFT JOIN LATERAL ( \
                        SELECT o.seq, o.next_attempt_at FROM ( \
                            (SELECT p.seq, p.next_attempt_at FROM {t} p \
                             WHERE p.ordering_key = m.ordering_key AND p.seq >= $4 AND p.seq < m.top \
                               AND p.seq NOT IN (SELECT seq FROM kept) \
                             ORDER BY p.seq LIMIT 1) \
                            UNION ALL \
                            (SELECT p.seq, p.next_attempt_at FROM {t} p \
                             WHERE p.ordering_key = m.ordering_key AND p.seq < least($4, m.top) \
                               AND p.next_attempt_at <> '-infinity' \
                               AND p.seq NOT IN (SELECT seq FROM kept) \
                             ORDER BY p.seq LIMIT 1)) o \
                        WHERE m.ordering_key IS NOT NULL AND m.seq = m.top \
                        ORDER BY o.seq LIMIT 1) b ON true \
                 ), gated AS ( \
                    SELECT p.*, \
                           CASE WHEN p.ordering_key IS NOT NULL THEN p.key_paused_from END AS paused_from, \
                           max(p.gap1) OVER k AS gap, max(p.gap_until1) OVER k AS gap_until, \
                           max(p.parked1) OVER k AS parked_from \
                    FROM probed p WINDOW k AS (PARTITION BY p.ordering_key) \
                 ), verdict AS ( \
                    SELECT g.*, \
                           g.paused OR coalesce(g.paused_from <= g.seq, false) \
                             OR coalesce(g.gap < g.seq, false) OR coalesce(g.parked_from < g.seq, false) AS blocked, \
                           CASE WHEN g.paused OR g.paused_from <= g.seq OR g.parked_from < g.seq \
                                  THEN greatest(now() + make_interval(secs => $3), g.gap_until) \
                                WHEN g.gap < g.seq AND g.gap_until > now() THEN g.gap_until \
                           END AS hold_until \
                    FROM gated g \
                 ) \
                 SELECT v.seq, x.message_id, v.destination, v.ordering_key, x.routing_key, x.headers, \
                        x.content_type, x.event_type, x.created_at, x.attempts, v.blocked, v.hold_until, \
                        CASE WHEN v.blocked THEN NULL ELSE x.payload END AS payload \
                 FROM verdict v CROSS JOIN LATERAL ( \
                    SELECT m.message_id, m.routing_key, m.headers, m.content_type, m.event_type, \
                           m.created_at, m.attempts, m.payload \
                    FROM {t} m WHERE m.seq = v.seq OFFSET 0) x \
                 ORDER BY v.seq"
            ),
            hold: format!(
                "UPDATE {t} AS m SET next_attempt_at = u.until \
                 FROM unnest($1::bigint[], $2::timestamptz[]) AS u(seq, until) \
                 WHERE m.seq = u.seq AND m.next_attempt_at < u.until"
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
            fail: format!(
                "UPDATE {t} AS m SET attempts = m.attempts + 1, last_error = u.err, \
                    last_attempt_at = statement_timestamp(), \
                    next_attempt_at = statement_timestamp() + make_interval(secs => u.delay) \
                 FROM unnest($1::bigint[], $2::text[], $3::float8[]) AS u(seq, err, delay) \
                 WHERE m.seq = u.seq"
            ),
            note_batch_error: format!(
                "UPDATE {t} SET last_error = $2, last_attempt_at = now() WHERE seq = ANY($1)"
            ),
            // Names the newest column, so a schema a migration behind is refused
            // at start-up rather than at the first claim.
            exists: format!("SELECT event_type FROM {t} LIMIT 0"),
            // statement_timestamp(): when the settle ran, after the confirms
            // arrived (now() would be the claim's time, before publishing).
            retain: retain.then(|| {
                format!(
                    "WITH r AS (SELECT * FROM unnest($1::bigint[], $2::text[]) AS r(seq, receipt)), \
                     moved AS (DELETE FROM {t} m USING r WHERE m.seq = r.seq RETURNING m.*, r.receipt) \
                     INSERT INTO {pb} (seq, message_id, destination, ordering_key, routing_key, headers, \
                                       payload, content_type, event_type, created_at, attempts, published_at, receipt) \
                     SELECT seq, message_id, destination, ordering_key, routing_key, headers, payload, \
                            content_type, event_type, created_at, attempts, statement_timestamp(), receipt::jsonb \
                     FROM moved"
                )
            }),
            // SKIP LOCKED: two replicas cleaning at once split the work instead
            // of queueing on each other's rows.
            purge: format!(
                "DELETE FROM {pb} WHERE seq IN ( \
                    SELECT seq FROM {pb} WHERE published_at < now() - make_interval(secs => $1) \
                    ORDER BY published_at LIMIT $2 FOR UPDATE SKIP LOCKED)"
            ),
        }
    }
}
