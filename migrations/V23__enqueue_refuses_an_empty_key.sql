-- enqueue() refuses an empty ordering key, and checks reserved header
-- names in the "C" collation.
--
-- An empty key is a key: a wrapper that passes its language's empty string
-- for "no key" put every such message, for every destination, in one lane
-- (one partition, one replica), and one dead letter among them parked them
-- all. It is refused now, like an empty event type: pass NULL for none.
-- The reserved-name check lowered names in the database's collation, and in
-- a Turkish one lower('MESSAGE-ID') is 'message-ıd', so the header passed.
-- The rest of the body is V22's.
--
-- Additive: the signature is unchanged, and relays never call enqueue().
-- Plain INSERTs into messages are not checked.
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
    limit_bytes pg_catalog.int4 := coalesce(enqueue.max_payload_bytes, 983040);
BEGIN
    IF enqueue.destination IS NULL OR enqueue.destination OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'outbox: message destination is empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.key OPERATOR(pg_catalog.=) '' THEN
        RAISE EXCEPTION 'outbox: ordering key is empty (pass NULL for none)'
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
    IF pg_catalog.octet_length(enqueue.payload) OPERATOR(pg_catalog.>) limit_bytes THEN
        RAISE EXCEPTION 'outbox: payload of % bytes exceeds the limit of % bytes',
            pg_catalog.octet_length(enqueue.payload), limit_bytes
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
        IF pg_catalog.lower(name COLLATE pg_catalog."C") OPERATOR(pg_catalog.=) ANY (ARRAY['message-id', 'content-type']::pg_catalog.text[]) THEN
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
