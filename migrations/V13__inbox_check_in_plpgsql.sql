-- inbox_process_once() in PL/pgSQL, with schema-qualified names.
--
-- Consumers in other languages call it once per message, inside the
-- transaction that applies the message's effect. As a SQL-language function
-- (V3) its INSERT was planned again on every call, and its `SET search_path
-- FROM CURRENT` applied and undone. Measured with pgbench against the same
-- INSERT ... ON CONFLICT DO NOTHING sent as plain SQL, three rounds each
-- (docs/benchmarks.md, "The inbox check in PL/pgSQL"): V3's function ran at
-- about 0.82 of the statement from one connection and 0.78-0.80 from 16;
-- this one at 0.98-1.02 and 0.97-1.01. PL/pgSQL keeps the INSERT's plan for
-- the session's life, and the body names the inbox with its schema instead
-- of pinning the path (as V12 did for enqueue()).
--
-- Additive: same signature and result (true when this consumer has not
-- recorded this id; false for a duplicate, after waiting for a concurrent
-- transaction that holds the same id to end), same errors (the inbox's
-- checks and NOT NULL). inbox_purge() is called rarely and stays as V3 made
-- it. Renaming the schema after this migration breaks the function, as it
-- did before.
DO $migrate$
BEGIN
    EXECUTE replace($template$
CREATE OR REPLACE FUNCTION @outbox@.inbox_process_once(p_consumer text, p_message_id text)
RETURNS boolean
LANGUAGE plpgsql
VOLATILE
AS $fn$
BEGIN
    INSERT INTO @outbox@.inbox (consumer, message_id)
    VALUES (p_consumer, p_message_id)
    ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$fn$
$template$, '@outbox@', quote_ident(current_schema()));
END
$migrate$;
