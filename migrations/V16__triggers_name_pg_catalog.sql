-- The two trigger functions name the built-ins they call as pg_catalog's, as
-- enqueue() (V14) and uuid_v7() (V15) do.
--
-- A trigger function has no SET clause here, so its body runs under the
-- search_path of the session whose statement fired it: the application's.
-- A path that puts pg_catalog after a schema of the caller's (which Postgres
-- offers for overriding built-ins) found the caller's look-alikes first:
-- - idempotency_keys_require_completed(), the commit-time guard, compared
--   with the caller's `=` for text. One that never matches let a key commit
--   while still 'in_progress': an effect committed with no response to
--   replay, which the guard exists to refuse.
-- - notify_messages(), the insert trigger that runs only with `notify on`,
--   called the caller's pg_notify() and `||`. A look-alike swallowed or
--   redirected the wake-up; polling still found the rows, a poll interval
--   later.
--
-- Both bodies now call pg_catalog's functions and operators, and declare
-- pg_catalog's types, by name; the guard's dynamic query does too. The
-- guard's WHEN clause and the tables' checks were parsed when they were
-- created and were never exposed.
--
-- Additive: same names, triggers, results and errors. The notify trigger
-- keeps whatever state `notify on|off` left it in. Relays and clients of the
-- previous version see no difference.
CREATE OR REPLACE FUNCTION notify_messages() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.pg_notify(
        TG_TABLE_SCHEMA::pg_catalog.text OPERATOR(pg_catalog.||) '.messages', '');
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION idempotency_keys_require_completed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    current_state pg_catalog.text;
BEGIN
    EXECUTE pg_catalog.format(
            'SELECT state FROM %I.%I '
            'WHERE scope OPERATOR(pg_catalog.=) $1 AND key OPERATOR(pg_catalog.=) $2',
            TG_TABLE_SCHEMA, TG_TABLE_NAME)
        INTO current_state
        USING NEW.scope, NEW.key;
    IF current_state OPERATOR(pg_catalog.=) 'in_progress' THEN
        RAISE EXCEPTION 'idempotency key % in scope % would commit without a stored response',
            NEW.key, NEW.scope
            USING ERRCODE = 'integrity_constraint_violation',
                  HINT = 'complete the request (store its response) before committing, or roll back';
    END IF;
    RETURN NULL;
END
$$;
