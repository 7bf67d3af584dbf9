-- Work sharing between relay replicas, and a place for messages that cannot be
-- delivered.

-- Virtual partition of a row: 64 buckets from a stable hash of the ordering key,
-- so one key always lands in one partition (one replica at a time handles it).
-- Rows without a key spread by seq. The count is part of the schema: changing it
-- is a migration, never a flag two replicas could disagree on.
ALTER TABLE messages
    ADD COLUMN partition smallint NOT NULL GENERATED ALWAYS AS (
        CASE WHEN ordering_key IS NULL THEN seq % 64
             ELSE ((hashtext(ordering_key) % 64) + 64) % 64
        END) STORED;

-- Who is (or was) running. Liveness is not read from here: a replica is alive
-- while its session holds its presence advisory lock. This table only names
-- the lock's holder for `outbox-relay status`.
CREATE TABLE replicas (
    slot         integer     PRIMARY KEY,   -- the presence lock's second key
    host         text        NOT NULL,
    pid          integer     NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    seen_at      timestamptz NOT NULL DEFAULT now(),
    -- Reported with each heartbeat, for `status`.
    in_flight         integer     NOT NULL DEFAULT 0,
    published         bigint      NOT NULL DEFAULT 0,
    broker_down_since timestamptz,
    broker_error      text
);

-- When each partition was taken by its current owner (informational; the
-- advisory lock is the ownership).
CREATE TABLE partition_owners (
    partition    smallint    PRIMARY KEY,
    slot         integer     NOT NULL,
    since        timestamptz NOT NULL DEFAULT now()
);

-- Messages that failed permanently or ran out of attempts, with why. The
-- original seq is kept so a retry re-enters the outbox in its key's order.
CREATE TABLE dead_letters (
    seq             bigint      PRIMARY KEY,
    message_id      uuid        NOT NULL UNIQUE,
    destination     text        NOT NULL,
    ordering_key    text,
    routing_key     text        NOT NULL,
    headers         jsonb       NOT NULL,
    payload         bytea       NOT NULL,
    content_type    text,
    created_at      timestamptz NOT NULL,
    attempts        integer     NOT NULL,
    last_error      text        NOT NULL,
    last_attempt_at timestamptz,
    dead_at         timestamptz NOT NULL DEFAULT now()
);

-- "Is an older message of this key dead-lettered?" (parking) is one probe.
CREATE INDEX dead_letters_key_seq ON dead_letters (ordering_key, seq) WHERE ordering_key IS NOT NULL;
