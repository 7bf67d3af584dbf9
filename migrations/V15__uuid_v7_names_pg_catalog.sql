-- uuid_v7() names the built-ins it calls as pg_catalog's, as enqueue() does
-- since V14.
--
-- uuid_v7() is the default of messages.message_id, so every INSERT that
-- names no id calls it, from any language, and enqueue() calls it too. It
-- has been a SQL function with no SET clause since V7, so its body ran under
-- the caller's search_path. A path that puts pg_catalog after a schema of
-- the caller's (which Postgres offers for overriding built-ins) found the
-- caller's own gen_random_uuid() or clock_timestamp() first: with
-- look-alikes that return a constant, every id came out the same
-- (00000000-0000-3000-0000-000000000000, not even version 7), and the
-- second INSERT failed on the unique message_id.
--
-- The body now calls pg_catalog's functions, operator and types by name.
-- OVERLAY, SUBSTRING ... FROM and EXTRACT are written in their special
-- syntax, which Postgres always resolves to pg_catalog's. It stays a SQL
-- function with no SET clause, so Postgres still inlines it into the INSERT.
--
-- Additive: same name, result and behaviour; relays and clients of the
-- previous version see no difference.
CREATE OR REPLACE FUNCTION uuid_v7() RETURNS uuid
LANGUAGE sql
VOLATILE
AS $$
    SELECT pg_catalog.encode(
        pg_catalog.set_bit(
            pg_catalog.set_bit(
                overlay(pg_catalog.uuid_send(pg_catalog.gen_random_uuid())
                        PLACING substring(pg_catalog.int8send(
                            (extract(epoch FROM pg_catalog.clock_timestamp())
                                OPERATOR(pg_catalog.*) 1000)::pg_catalog.int8) FROM 3)
                        FROM 1 FOR 6),
                52, 1),
            53, 1),
        'hex')::pg_catalog.uuid
$$;
