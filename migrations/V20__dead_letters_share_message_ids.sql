-- Two dead letters may carry one message id.
--
-- `messages.message_id` is unique among the rows still in the outbox only,
-- so an app may enqueue an id again once its first message has left (the
-- client's `message_id` makes an enqueue idempotent). When the first had
-- left as a dead letter and the second failed for good too, moving it to
-- `dead_letters` broke that table's UNIQUE (message_id): the settle of its
-- batch rolled back, so the whole batch was published again at every
-- claim, and the key never moved. Both are kept now, each under its own
-- seq; `dead-letters list --id` shows both, and retrying them together
-- is refused as long as both would be in the outbox at once.
--
-- Additive for a rolling deploy: a constraint is relaxed, no statement of
-- an older relay depends on it, and the lookups by id keep an index.
ALTER TABLE dead_letters DROP CONSTRAINT IF EXISTS dead_letters_message_id_key;
CREATE INDEX IF NOT EXISTS dead_letters_message_id ON dead_letters (message_id);
