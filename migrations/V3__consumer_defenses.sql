-- Consumer-side defenses against duplicate runs: an inbox of processed message
-- ids, a record of sent notifications and checkpoints for long jobs.
--
-- Each works the same way: a unique key, written in the same transaction as the
-- effect it guards, so the effect and its record commit or vanish together and
-- a concurrent or later attempt with the same key finds the row and stops.

-- Deliveries a consumer has applied. The key is (consumer, message id): several
-- consumers of one stream each apply a message once, independently.
CREATE TABLE inbox (
    consumer     text        NOT NULL CHECK (consumer <> ''),
    -- Text, not uuid: besides outbox ids this holds webhook event ids
    -- ('evt_...') and ids of any other producer.
    message_id   text        NOT NULL CHECK (message_id <> ''),
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Retention deletes the oldest entries first, a batch at a time.
CREATE INDEX inbox_processed_at ON inbox (processed_at);

-- The inbox check for consumers written in other languages. Returns true when
-- this (consumer, message id) is new and the caller should apply its effect in
-- the same transaction; false for a duplicate. search_path is pinned to this
-- schema because a function resolves table names when it runs, not when it
-- is created.
CREATE FUNCTION inbox_process_once(p_consumer text, p_message_id text)
RETURNS boolean
LANGUAGE sql
VOLATILE
SET search_path FROM CURRENT
AS $$
    WITH ins AS (
        INSERT INTO inbox (consumer, message_id)
        VALUES (p_consumer, p_message_id)
        ON CONFLICT DO NOTHING
        RETURNING 1
    )
    SELECT count(*) = 1 FROM ins
$$;

-- Deletes at most p_batch entries processed before now() - p_older_than and
-- returns how many it deleted; call it until it returns 0. Small batches keep
-- each delete's locks and WAL short. The window must be longer than any
-- redelivery can be late, or a late copy is applied again.
CREATE FUNCTION inbox_purge(p_older_than interval, p_batch integer)
RETURNS bigint
LANGUAGE sql
VOLATILE
SET search_path FROM CURRENT
AS $$
    WITH doomed AS (
        SELECT consumer, message_id FROM inbox
        WHERE processed_at < now() - p_older_than
        ORDER BY processed_at
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM inbox i USING doomed d
        WHERE i.consumer = d.consumer AND i.message_id = d.message_id
        RETURNING 1
    )
    SELECT count(*) FROM gone
$$;

-- Notifications sent once per (recipient, kind, period), e.g. ('42', 'welcome',
-- 'once') or ('42', 'weekly_report', '2026-W42').
CREATE TABLE sent_notifications (
    recipient   text        NOT NULL CHECK (recipient <> ''),
    kind        text        NOT NULL CHECK (kind <> ''),
    period      text        NOT NULL CHECK (period <> ''),
    recorded_at timestamptz NOT NULL DEFAULT now(),
    -- NULL while a record-then-send attempt has not confirmed its send: a row
    -- left NULL after a crash is a notification that may never have gone out.
    sent_at     timestamptz,
    PRIMARY KEY (recipient, kind, period)
);

-- How far each checkpointed job got: the last key whose batch committed. It is
-- updated in the same transaction as that batch's effect.
CREATE TABLE checkpoints (
    job        text        PRIMARY KEY CHECK (job <> ''),
    position   bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
