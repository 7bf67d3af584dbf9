-- enqueue() names the built-in functions and operators it checks with.
--
-- Until V12, enqueue() ran under the path pinned when it was created, on
-- which pg_catalog came first. V12 dropped that SET clause for speed, and
-- the body has since run under the caller's path. Postgres searches
-- pg_catalog first unless a path names it later, which its documentation
-- offers for "user-defined names to override built-in names", and which
-- Oracle-compatibility setups use to get their own LENGTH or SUBSTR. Under
-- such a path V12's checks called the caller's look-alikes instead of the
-- built-ins: a look-alike `octet_length()` let an oversized payload in,
-- and a look-alike `=` let an empty destination in.
--
-- The body now names every function and operator it calls with
-- pg_catalog (`pg_catalog.octet_length(...)`, `OPERATOR(pg_catalog.=)`),
-- resolved when each statement is first planned, so a call costs what
-- V12's did. The outbox's own objects keep their schema, written in when
-- this migration runs, as in V12.
--
-- Additive: the signature, defaults, checks, errors and result are V12's,
-- so clients and relays of the previous version see no difference.
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
