-- Two ordered paths for the claim, so that neither walks rows that cannot go
-- out yet.
--
-- Fresh rows (never refused, not held) are found in seq order. A key whose
-- head is blocked (waiting out a retry, or parked behind a dead letter) has
-- its later rows set aside by giving them a future next_attempt_at: they
-- leave this index, so a hot key with thousands of rows waiting behind a
-- blocked head costs each claim nothing, instead of filling every claim with
-- rows that cannot be published.
CREATE INDEX messages_fresh ON messages (seq) WHERE next_attempt_at = '-infinity';

-- Rows with a time of their own (retries, and rows set aside behind their
-- key's head) are found when that time comes, oldest time first.
CREATE INDEX messages_due ON messages (next_attempt_at, seq) WHERE next_attempt_at > '-infinity';
