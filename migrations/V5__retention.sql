-- Retention mode (`outbox-relay run --retention <duration>`): instead of being
-- deleted on confirm, a published message moves here in the transaction that
-- settles its batch, with when it was published and what the broker answered.
-- The relay deletes rows past the retention in small batches.
--
-- A table of its own rather than a flag on `messages`: the claim query and its
-- indexes see only rows still to publish, however many are retained.

CREATE TABLE published (
    seq           bigint      PRIMARY KEY,  -- the row's seq in `messages`
    message_id    uuid        NOT NULL,
    destination   text        NOT NULL,
    ordering_key  text,
    routing_key   text        NOT NULL,
    headers       jsonb       NOT NULL,
    payload       bytea       NOT NULL,
    content_type  text,
    created_at    timestamptz NOT NULL,
    attempts      integer     NOT NULL,     -- failed attempts before the one that succeeded
    published_at  timestamptz NOT NULL,
    -- {"broker":"kafka","topic":..,"partition":..,"offset":..} or
    -- {"broker":"rabbitmq","confirm":"ack","exchange":..,"routing_key":..}
    receipt       jsonb       NOT NULL
);

-- `locate <message-id>`. Not unique: a caller may reuse an id once its first
-- message has left the outbox.
CREATE INDEX published_message_id ON published (message_id);
-- The cleanup's oldest-first scan.
CREATE INDEX published_published_at ON published (published_at);
