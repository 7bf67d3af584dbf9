-- Least-privilege roles for one outbox schema. Run after `outbox-relay
-- migrate`, as the schema's owner with CREATEROLE (or as a superuser): the
-- script creates the three group roles below (NOLOGIN). Then give each
-- service a login of its own in the role it needs:
--
--   psql -v schema=outbox -f deploy/roles.sql
--   CREATE ROLE outbox_relay_login LOGIN IN ROLE outbox_relay PASSWORD '...';  -- from your secret store
--
-- The role names are cluster-wide: run for a second outbox schema (or in a
-- second database), the same roles get that schema's rights too. Where two
-- outboxes must not reach each other's rows, rename the roles in a copy of
-- this script for each.
--
-- outbox_app:   may only add messages to the outbox (and use the consumer-side
--               inbox, send-once, checkpoint and idempotency tables);
--               it cannot read, change or delete outbox rows.
-- outbox_relay: may read, settle and dead-letter outbox rows, keep published
--               rows in retention mode, and keep its replica bookkeeping;
--               nothing else. `status`, `locate`, `pause`, `resume` and
--               `dead-letters list/show` run with it.
-- outbox_operator: the relay's rights, and what `dead-letters retry` and
--               `discard` need beyond them: putting dead letters back into
--               the outbox and removing them.
\set ON_ERROR_STOP on

DO $$ BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_app') THEN CREATE ROLE outbox_app NOLOGIN; END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_relay') THEN CREATE ROLE outbox_relay NOLOGIN; END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_operator') THEN CREATE ROLE outbox_operator NOLOGIN; END IF;
END $$;

GRANT USAGE ON SCHEMA :"schema" TO outbox_app, outbox_relay;

-- The app: INSERT only, directly or through outbox.enqueue(...) (functions
-- run with the caller's rights and are executable by everyone). The insert
-- trigger (NOTIFY) and the message id's default need nothing more.
GRANT INSERT ON :"schema".messages TO outbox_app;
-- outbox_client::migrate() at the app's start-up: with nothing pending it
-- only reads the migrations' history.
GRANT SELECT ON :"schema".refinery_schema_history TO outbox_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".inbox, :"schema".sent_notifications,
    :"schema".checkpoints, :"schema".idempotency_keys TO outbox_app;

-- The relay: claim (SELECT ... FOR UPDATE), settle (DELETE), record failures
-- (UPDATE), dead-letter, and its replica bookkeeping. `status` reads pg_locks,
-- which every role may read, and pg_stat_activity, where a role sees other
-- users' sessions without their transaction start unless it has
-- pg_read_all_stats: without it `status` cannot name the long transaction
-- that holds the relay back. Granting it takes a superuser (or a role with
-- ADMIN on pg_read_all_stats); otherwise the script says so and goes on.
GRANT SELECT, UPDATE, DELETE ON :"schema".messages TO outbox_relay;
-- The claim floor reads the seq sequence's last value (never draws from it).
GRANT SELECT ON SEQUENCE :"schema".messages_seq_seq TO outbox_relay;
GRANT SELECT, INSERT ON :"schema".dead_letters TO outbox_relay;
-- Retention mode moves published rows here and deletes them after a while.
GRANT SELECT, INSERT, DELETE ON :"schema".published TO outbox_relay;
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".replicas, :"schema".partition_owners TO outbox_relay;
-- Every claim reads the paused destinations; `pause` and `resume`, run with
-- this role, change them.
GRANT SELECT, INSERT, UPDATE, DELETE ON :"schema".paused_destinations TO outbox_relay;

-- The operator: the relay's rights (a member of its role), and
-- `dead-letters retry` (a dead letter moves back into the outbox, under its
-- old seq) and `discard` (it is deleted).
GRANT outbox_relay TO outbox_operator;
GRANT INSERT ON :"schema".messages TO outbox_operator;
GRANT DELETE ON :"schema".dead_letters TO outbox_operator;

DO $$ BEGIN
    GRANT pg_read_all_stats TO outbox_relay;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE NOTICE 'could not grant pg_read_all_stats to outbox_relay: `outbox-relay status` run as it will not see other users'' long transactions; have a superuser run GRANT pg_read_all_stats TO outbox_relay';
END $$;
