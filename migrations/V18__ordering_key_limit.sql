-- Ordering keys of at most 2,048 bytes.
--
-- A row's ordering key is indexed with its seq (messages_key_seq and the
-- waiting-by-key indexes), and a btree entry holds at most 2,704 bytes of a
-- value that does not compress. A longer key failed its INSERT with "index
-- row size exceeds btree version 4 maximum", a program_limit_exceeded error
-- that names an index, not the key; a key that compresses well got through
-- at any length. The limit is now the same for every key, and named:
--
-- - a check constraint on messages refuses a plain INSERT of a longer key
--   (check_violation, constraint messages_ordering_key_length). It is added
--   NOT VALID, so that adding it does not read a backlog under the table's
--   lock: rows already written keep their keys and are published as before;
-- - enqueue() refuses one like its other bad input: SQLSTATE 22023 and
--   "outbox: ordering key of N bytes exceeds the limit of 2048 bytes".
--   The rest of its body is V14's;
-- - outbox-client refuses one before sending any SQL
--   (Error::OrderingKeyTooLong).
--
-- Additive: relays of the previous version never write a key of their own.
-- One exception: `dead-letters retry` moves a row back into messages, and
-- a dead letter whose key is over the limit, written before this migration,
-- is then refused by the constraint; such a row can still be discarded.
ALTER TABLE messages ADD CONSTRAINT messages_ordering_key_length
    CHECK (pg_catalog.octet_length(ordering_key) <= 2048) NOT VALID;

DO $migrate$
BEGIN
    EXECUTE replace($template$
CREATE OR REPLACE FUNCTION @outbox@.enqueue(
    destination       text,
    payload           bytea,
    key               text    DEFAULT NULL,
    routing_key       text    DEFAULT '',
    headers           jsonb   DEFAULT '{}'::jsonb,
    content_type      text    DEFAULT 'application/octet-stream',
    message_id        uuid    DEFAULT NULL,
    max_payload_bytes integer DEFAULT 983040,
    event_type        text    DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
AS $fn$
DECLARE
    id   pg_catalog.uuid := coalesce(enqueue.message_id, @outbox@.uuid_v7());
    name pg_catalog.text;
BEGIN
    IF enqueue.destination IS NULL OR enqueue.destination OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'outbox: message destination is empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.octet_length(enqueue.key) OPERATOR(pg_catalog.>) 2048 THEN
        RAISE EXCEPTION 'outbox: ordering key of % bytes exceeds the limit of 2048 bytes',
            pg_catalog.octet_length(enqueue.key)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'outbox: payload is null (send an empty bytea for an empty message)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.octet_length(enqueue.payload) OPERATOR(pg_catalog.>) enqueue.max_payload_bytes THEN
        RAISE EXCEPTION 'outbox: payload of % bytes exceeds the limit of % bytes',
            pg_catalog.octet_length(enqueue.payload), enqueue.max_payload_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.event_type OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'outbox: event type is empty (pass NULL for none)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.headers IS NULL
        OR pg_catalog.jsonb_typeof(enqueue.headers) OPERATOR(pg_catalog.<>) 'object' THEN
        RAISE EXCEPTION 'outbox: headers must be a JSON object of strings'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR name IN SELECT pg_catalog.jsonb_object_keys(enqueue.headers) LOOP
        IF name OPERATOR(pg_catalog.=) ''
            OR pg_catalog.octet_length(name) OPERATOR(pg_catalog.>) 255
            OR name OPERATOR(pg_catalog.!~) '^[!-~]+$' THEN
            RAISE EXCEPTION 'outbox: invalid header name %: 1 to 255 visible ASCII characters, no spaces', pg_catalog.to_json(name)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF pg_catalog.lower(name) OPERATOR(pg_catalog.=) ANY (ARRAY['message-id', 'content-type']::pg_catalog.text[]) THEN
            RAISE EXCEPTION 'outbox: invalid header name %: reserved, the relay sets it from the message itself', pg_catalog.to_json(name)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF pg_catalog.jsonb_typeof(enqueue.headers OPERATOR(pg_catalog.->) name) OPERATOR(pg_catalog.<>) 'string' THEN
            RAISE EXCEPTION 'outbox: header % must have a string value', pg_catalog.to_json(name)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    INSERT INTO @outbox@.messages (message_id, destination, ordering_key, routing_key, headers, payload,
                          content_type, event_type)
    VALUES (id, enqueue.destination, enqueue.key, coalesce(enqueue.routing_key, ''),
            enqueue.headers, enqueue.payload, enqueue.content_type, enqueue.event_type);
    RETURN id;
END
$fn$
$template$, '@outbox@', quote_ident(current_schema()));
END
$migrate$;
