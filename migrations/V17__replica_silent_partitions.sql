-- Each replica reports, with its heartbeat, the broker partitions that leave
-- its records unanswered while the rest of the broker answers (a Kafka
-- partition without a reachable leader), so that `outbox-relay status` names
-- them beside an unreachable broker: a JSON array of
-- {"topic", "partition", "since"}.
--
-- Additive: relays of the previous version do not write the column and read
-- nothing from it; it stays empty for them. A relay of this version refuses
-- a schema without it at start-up, as it does any schema a migration behind.
ALTER TABLE replicas ADD COLUMN silent_partitions jsonb NOT NULL DEFAULT '[]';
