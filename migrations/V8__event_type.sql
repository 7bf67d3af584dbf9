-- An event type per message, for consumers that dispatch on it and for the
-- relay's CloudEvents mode (`--cloudevents`), where it becomes `type`.
--
-- Additive: the column is nullable with no default, so a relay or client of
-- the previous version keeps working beside this one. A relay of the previous
-- version that dead-letters or retains a message does not copy its event type;
-- finish a rolling deploy before relying on event types in dead letters.
ALTER TABLE messages ADD COLUMN event_type text;
ALTER TABLE dead_letters ADD COLUMN event_type text;
ALTER TABLE published ADD COLUMN event_type text;

-- enqueue() gains an event_type argument, last, so calls that pass arguments
-- by position keep their meaning. The old signature is dropped rather than
-- overloaded: two versions with defaults would make a call by name ambiguous.
DROP FUNCTION enqueue(text, bytea, text, text, jsonb, text, uuid, integer);

CREATE FUNCTION enqueue(
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
    INSERT INTO messages (message_id, destination, ordering_key, routing_key, headers, payload,
                          content_type, event_type)
    VALUES (id, enqueue.destination, enqueue.key, coalesce(enqueue.routing_key, ''),
            enqueue.headers, enqueue.payload, enqueue.content_type, enqueue.event_type);
    RETURN id;
END
$$;
