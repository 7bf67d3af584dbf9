-- Dead letters keyed by an id of their own, so two may carry one seq.
--
-- A sequence set back (`TRUNCATE messages RESTART IDENTITY`, `setval`),
-- which the relay follows, hands out seqs that dead letters from before
-- may still have. Moving a new row that failed for good to the dead letters
-- then broke their primary key on seq: the settle of its batch rolled back,
-- and the batch went out again at every claim for as long as the old dead
-- letter stayed. seq stays, indexed, for the order of a retry; `id` is the
-- key. Retrying two dead letters of one seq together is refused, as for
-- two of one message id (V20).
--
-- Additive for a rolling deploy: no statement of an older relay names the
-- old key, and their inserts list their columns, so `id` fills itself.
-- Adding the column rewrites the table under an exclusive lock, as long as
-- a copy of the dead letters takes.
ALTER TABLE dead_letters DROP CONSTRAINT IF EXISTS dead_letters_pkey;
ALTER TABLE dead_letters ADD COLUMN IF NOT EXISTS id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY;
CREATE INDEX IF NOT EXISTS dead_letters_seq ON dead_letters (seq);
