-- Producers in any language, and holding back one destination.
--
-- Objects are created unqualified; the migration runner sets search_path to
-- the configured schema. Functions pin search_path to that schema because a
-- function resolves table names when it runs, not when it is created.

-- A UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, then random bits, so ids
-- sort by creation time like the ones outbox-client makes. Postgres 17 has
-- uuidv7() built in; this works from 14 on.
CREATE FUNCTION uuid_v7() RETURNS uuid
LANGUAGE sql
VOLATILE
AS $$
    SELECT encode(
        set_bit(
            set_bit(
                overlay(uuid_send(gen_random_uuid())
                        PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                        FROM 1 FOR 6),
                52, 1),
            53, 1),
        'hex')::uuid
$$;

-- A plain INSERT that names no message id gets a time-ordered one.
ALTER TABLE messages ALTER COLUMN message_id SET DEFAULT uuid_v7();

-- Enqueue from any language, in the caller's transaction, with the checks
-- outbox-client makes, and the new message's id back:
--
--   SELECT outbox.enqueue('orders', '{"order": 42}'::bytea, key => 'order-42',
--                         content_type => 'application/json');
--
-- Errors are SQLSTATE 22023 (invalid_parameter_value) with a message that
-- names the problem, raised before anything is written.
CREATE FUNCTION enqueue(
    destination       text,
    payload           bytea,
    key               text    DEFAULT NULL,
    routing_key       text    DEFAULT '',
    headers           jsonb   DEFAULT '{}'::jsonb,
    content_type      text    DEFAULT 'application/octet-stream',
    message_id        uuid    DEFAULT NULL,
    max_payload_bytes integer DEFAULT 983040
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    id   uuid := coalesce(enqueue.message_id, uuid_v7());
    name text;
BEGIN
    IF enqueue.destination IS NULL OR enqueue.destination = '' THEN
        RAISE EXCEPTION 'outbox: message destination is empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.payload IS NULL THEN
        RAISE EXCEPTION 'outbox: payload is null (send an empty bytea for an empty message)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(enqueue.payload) > enqueue.max_payload_bytes THEN
        RAISE EXCEPTION 'outbox: payload of % bytes exceeds the limit of % bytes',
            octet_length(enqueue.payload), enqueue.max_payload_bytes
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.headers IS NULL OR jsonb_typeof(enqueue.headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox: headers must be a JSON object of strings'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR name IN SELECT jsonb_object_keys(enqueue.headers) LOOP
        IF name = '' OR octet_length(name) > 255 OR name !~ '^[!-~]+$' THEN
            RAISE EXCEPTION 'outbox: invalid header name %: 1 to 255 visible ASCII characters, no spaces', to_json(name)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF lower(name) IN ('message-id', 'content-type') THEN
            RAISE EXCEPTION 'outbox: invalid header name %: reserved, the relay sets it from the message itself', to_json(name)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF jsonb_typeof(enqueue.headers -> name) <> 'string' THEN
            RAISE EXCEPTION 'outbox: header % must have a string value', to_json(name)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    INSERT INTO messages (message_id, destination, ordering_key, routing_key, headers, payload, content_type)
    VALUES (id, enqueue.destination, enqueue.key, coalesce(enqueue.routing_key, ''),
            enqueue.headers, enqueue.payload, enqueue.content_type);
    RETURN id;
END
$$;

-- Destinations an operator has paused (`outbox-relay pause <destination>`).
-- Their rows wait in the outbox, not claimed and not counted as attempts,
-- for every replica, across restarts, until `resume`.
CREATE TABLE paused_destinations (
    destination text        PRIMARY KEY,
    paused_at   timestamptz NOT NULL DEFAULT now(),
    reason      text
);
