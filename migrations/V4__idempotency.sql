-- Idempotency records for HTTP endpoints: one row per (scope, key) a client sent,
-- written in the same transaction as the request's effect and holding the
-- response to replay when the client sends the key again.
--
-- Objects are created unqualified; the migration runner sets search_path to the
-- configured schema.

CREATE TABLE idempotency_keys (
    -- Who may reuse a key and where, e.g. 'tenant:7 user:42 POST /credits'. Two
    -- scopes never see each other's keys.
    scope                  text        NOT NULL,
    -- The client's Idempotency-Key header, 1 to 255 visible ASCII characters.
    key                    text        NOT NULL
                                       CHECK (octet_length(key) BETWEEN 1 AND 255),
    -- SHA-256 over method, path and body: the same key with a different request
    -- is a client bug, answered 422, never a replay of someone else's answer.
    fingerprint            bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- 'in_progress' exists only inside the transaction that runs the request: the
    -- deferred trigger below refuses to commit it, so a committed row is always
    -- 'completed' and a crash before commit leaves nothing behind.
    state                  text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    response_status        integer     CHECK (response_status BETWEEN 100 AND 999),
    -- Only the headers worth replaying (content-type, location, ...), in order;
    -- values as raw bytes so the replay is byte for byte.
    response_header_names  text[],
    response_header_values bytea[],
    response_body          bytea,
    created_at             timestamptz NOT NULL DEFAULT now(),
    completed_at           timestamptz,
    -- After this the key is free again: a request reusing it runs anew.
    expires_at             timestamptz NOT NULL,
    PRIMARY KEY (scope, key),
    CHECK (state = 'in_progress'
           OR (response_status IS NOT NULL AND response_header_names IS NOT NULL
               AND response_header_values IS NOT NULL AND response_body IS NOT NULL
               AND completed_at IS NOT NULL)),
    CHECK (cardinality(response_header_names) = cardinality(response_header_values))
);

-- Cleanup walks expired rows oldest first, a small batch at a time.
CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);

-- Commit-time guard: an effect must never commit without the response that makes
-- its retries replay. Fires once per row written as 'in_progress' and looks at the
-- row as it is when the transaction commits.
CREATE FUNCTION idempotency_keys_require_completed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    current_state text;
BEGIN
    EXECUTE format('SELECT state FROM %I.%I WHERE scope = $1 AND key = $2',
                   TG_TABLE_SCHEMA, TG_TABLE_NAME)
        INTO current_state
        USING NEW.scope, NEW.key;
    IF current_state = 'in_progress' THEN
        RAISE EXCEPTION 'idempotency key % in scope % would commit without a stored response',
            NEW.key, NEW.scope
            USING ERRCODE = 'integrity_constraint_violation',
                  HINT = 'complete the request (store its response) before committing, or roll back';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER idempotency_keys_completed_at_commit
    AFTER INSERT OR UPDATE ON idempotency_keys
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.state = 'in_progress')
    EXECUTE FUNCTION idempotency_keys_require_completed();
