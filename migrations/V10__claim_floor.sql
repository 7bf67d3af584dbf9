-- The claim floor (see the relay's source/floor.rs): the claim scans fresh
-- rows from a seq below which none can exist, so it does not walk rows deleted
-- while an old snapshot elsewhere (a report, pg_dump, a forgotten BEGIN) keeps
-- their index entries from being marked dead.
--
-- The head-of-key probe then looks below the floor only for rows that wait
-- (in backoff, or set aside behind their key's head), which this index holds.
-- Rows are inserted fresh (next_attempt_at = '-infinity'), outside its
-- predicate, so writers never maintain it.
--
-- Additive: relays of the previous version ignore it. The relay's floor reads
-- the seq sequence's last value, so its role needs SELECT on the sequence
-- (deploy/roles.sql grants it); without, the relay runs with no floor.
CREATE INDEX messages_waiting_key_seq ON messages (ordering_key, seq)
    WHERE next_attempt_at > '-infinity' AND ordering_key IS NOT NULL;
