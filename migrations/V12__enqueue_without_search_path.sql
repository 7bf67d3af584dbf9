-- enqueue() without a pinned search_path, for writers at high concurrency.
--
-- V7 and V8 gave enqueue() `SET search_path FROM CURRENT`, so that its body
-- found `messages` in the outbox's schema whatever the caller's path. A SET
-- clause is applied and undone on every call, and the path recomputed each
-- time. Measured single-session, it cost about 7 % of the call's CPU; at
-- 64 connections on two cores, where the writers run out of CPU before the
-- disk runs out of flushes, the function without it commits about a tenth
-- more (docs/wake-path.md).
--
-- The body now names the outbox's own objects with their schema, written in
-- when this migration runs (the runner sets search_path to the configured
-- schema, so current_schema() is that schema). Everything else it calls is
-- in pg_catalog, which Postgres searches first unless a caller's path names
-- it later on purpose. The function stays SECURITY INVOKER, so such a path
-- can only affect the caller's own call.
--
-- Additive: the signature, defaults, checks, errors and result are V8's, so
-- clients and relays of the previous version see no difference. Renaming the
-- schema after this migration breaks enqueue(), as it did before (the pinned
-- path named the schema too).
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
    id   uuid := coalesce(enqueue.message_id, @outbox@.uuid_v7());
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
    IF enqueue.event_type = '' THEN
        RAISE EXCEPTION 'outbox: event type is empty (pass NULL for none)'
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
