-- inbox_process_once() refuses keys over 512 bytes by name.
--
-- The inbox indexes (consumer, message_id) together, and a btree entry
-- holds at most 2,704 bytes of keys that do not compress. A longer pair
-- failed the INSERT with "index row size exceeds btree version 4 maximum",
-- an error that names an index, not the key. outbox-client refuses a key
-- over 512 bytes before any SQL (MAX_KEY_BYTES); consumers in other
-- languages now get the same limit from the function: SQLSTATE 22023 and
-- "outbox: message id of N bytes exceeds the limit of 512 bytes" (or
-- "consumer name"). The body otherwise is V13's, and names the built-ins
-- it checks with as pg_catalog's, as enqueue() does (V14).
--
-- Additive: same signature and result. A key between 513 bytes and what
-- the index holds was recorded before and is refused now; no relay calls
-- the function.
DO $migrate$
BEGIN
    EXECUTE replace($template$
CREATE OR REPLACE FUNCTION @outbox@.inbox_process_once(p_consumer text, p_message_id text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
AS $fn$
BEGIN
    IF pg_catalog.octet_length(p_consumer) OPERATOR(pg_catalog.>) 512 THEN
        RAISE EXCEPTION 'outbox: consumer name of % bytes exceeds the limit of 512 bytes',
            pg_catalog.octet_length(p_consumer)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF pg_catalog.octet_length(p_message_id) OPERATOR(pg_catalog.>) 512 THEN
        RAISE EXCEPTION 'outbox: message id of % bytes exceeds the limit of 512 bytes',
            pg_catalog.octet_length(p_message_id)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO @outbox@.inbox (consumer, message_id)
    VALUES (p_consumer, p_message_id)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$fn$
$template$, '@outbox@', quote_ident(current_schema()));
END
$migrate$;
