-- The outbox: one row per message an application committed and the relay has not
-- yet seen confirmed by the broker.
--
-- Objects are created unqualified; the migration runner sets search_path to the
-- configured schema (default "outbox") so the same file serves any schema name.

CREATE TABLE messages (
    -- Insertion order. Used to order rows of one key and to pick the oldest work,
    -- never as a "seen up to here" watermark: a transaction that commits late
    -- makes a lower seq visible after higher ones were already published.
    seq             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Stable id stamped on every publish attempt; consumers dedupe on it.
    message_id      uuid        NOT NULL UNIQUE,
    -- AMQP exchange or Kafka topic. '' is AMQP's default exchange.
    destination     text        NOT NULL,
    -- Rows with the same key are published in seq order, one replica at a time.
    -- NULL means the row carries no ordering constraint.
    ordering_key    text,
    routing_key     text        NOT NULL DEFAULT '',
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb
                                CHECK (jsonb_typeof(headers) = 'object'),
    payload         bytea       NOT NULL,
    content_type    text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- Failed publish attempts that the broker answered (returns, nacks, rejects).
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    last_attempt_at timestamptz,
    -- Backoff after a failure; '-infinity' means ready now.
    next_attempt_at timestamptz NOT NULL DEFAULT '-infinity'
);

-- Claim: "oldest ready rows" walks the primary key in seq order and stops after
-- one batch, whatever the backlog. Head-of-key check: "is there an older row of
-- this key?" is one probe of this index.
CREATE INDEX messages_key_seq ON messages (ordering_key, seq) WHERE ordering_key IS NOT NULL;

-- One notification per inserting statement, not per row; identical payloads in one
-- transaction fold into one. The channel carries the schema so several outboxes in
-- one database do not wake each other.
CREATE FUNCTION notify_messages() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.messages', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER messages_notify
    AFTER INSERT ON messages
    FOR EACH STATEMENT EXECUTE FUNCTION notify_messages();
