//! Times as RFC 3339 text, for any time Postgres can hand over.
//!
//! A `timestamptz` spans 4713 BC to 294276 AD, and `'infinity'` and
//! `'-infinity'` besides; RFC 3339 writes the years 0000 to 9999 only, and
//! common formatters take nothing before 1970 (humantime panics there).
//! A row written in plain SQL can carry any of them: a backfill keeps its
//! events' own times, and a fresh row's `next_attempt_at` is `'-infinity'`.

use std::time::{SystemTime, UNIX_EPOCH};

/// `t` as RFC 3339 in UTC with microseconds, as Postgres keeps it, or None
/// outside the years 0000 to 9999 that RFC 3339 can write.
pub fn rfc3339(t: SystemTime) -> Option<String> {
    let (secs, micros) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (i64::try_from(d.as_secs()).ok()?, d.subsec_micros()),
        Err(before) => {
            let d = before.duration();
            let secs = i64::try_from(d.as_secs()).ok()?;
            match d.subsec_micros() {
                0 => (-secs, 0),
                us => (-secs - 1, 1_000_000 - us),
            }
        }
    };
    let (days, of_day) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (year, month, day) = civil_from_days(days);
    if !(0..=9999).contains(&year) {
        return None;
    }
    Some(format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60
    ))
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_time_postgres_takes_is_written_or_none_never_a_panic() {
        let epoch = UNIX_EPOCH;
        let us = std::time::Duration::from_micros;
        // 1969-07-20 20:17:40.5 UTC and the microsecond before the epoch.
        assert_eq!(
            rfc3339(epoch - us(14_182_939_500_000)).as_deref(),
            Some("1969-07-20T20:17:40.500000Z")
        );
        assert_eq!(
            rfc3339(epoch - us(1)).as_deref(),
            Some("1969-12-31T23:59:59.999999Z")
        );
        // RFC 3339 spans years 0000 to 9999; Postgres goes wider, up to
        // 'infinity' (the most microseconds after 2000 an i64 holds).
        let pg_2000 = epoch + std::time::Duration::from_secs(946_684_800);
        assert_eq!(rfc3339(pg_2000 + us(i64::MAX as u64)), None);
        assert_eq!(rfc3339(pg_2000 - us(i64::MAX as u64)), None);
        assert_eq!(
            rfc3339(epoch - us(62_167_219_200_000_000)).as_deref(),
            Some("0000-01-01T00:00:00.000000Z")
        );
        assert_eq!(rfc3339(epoch - us(62_167_219_200_000_001)), None);
        assert_eq!(
            rfc3339(epoch + us(253_402_300_799_999_999)).as_deref(),
            Some("9999-12-31T23:59:59.999999Z")
        );
        assert_eq!(rfc3339(epoch + us(253_402_300_800_000_000)), None);
        // Within 1970-9999, the same text as humantime's, over a spread.
        let mut t: u64 = 1;
        while t < 253_402_300_799_999_999 {
            assert_eq!(
                rfc3339(epoch + us(t)),
                Some(humantime::format_rfc3339_micros(epoch + us(t)).to_string()),
                "{t}"
            );
            t = t * 3 + 7_654_321;
        }
    }
}
