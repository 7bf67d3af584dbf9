-- The head-of-key probe's look below the claim floor, at rows that wait (see
-- V10), through an index no other path of the claim can stand in for.
--
-- V10's index shares its predicate, `next_attempt_at > '-infinity'`, with
-- `messages_due`, so the planner may answer the probe from `messages_due`
-- instead: with the key as a filter, that reads every waiting row, for every
-- key of every claim. A relay session keeps the plan it made at its first
-- claim. One planned while nothing waited (statistics of a healthy outbox)
-- took 5 s and 1.5 million buffers per claim once 20,000 rows waited (a
-- paused destination, a broker refusing one destination). This index's
-- predicate, `<> '-infinity'`, means the same rows, but only a query that
-- says `<>` can use it, and the probe is the only one that does: no other
-- partial index fits the probe, so its plan cannot drift to one.
--
-- Additive: a relay of the previous version keeps using V10's index, and
-- this relay runs on a V10 schema (its probe then reads the keyed index,
-- slower under a pinned snapshot). V10's index is dropped by a later
-- migration, once no relay of that version runs.
CREATE INDEX messages_waiting_by_key ON messages (ordering_key, seq)
    WHERE next_attempt_at <> '-infinity' AND ordering_key IS NOT NULL;
