//! Five-field cron expressions (`minute hour day-of-month month day-of-week`, read as wall-clock
//! time in whatever zone the caller evaluates them in): `*`, numbers,
//! ranges `a-b`, steps `*/n` and `a-b/n`, and lists of those. Day of month and day of week follow
//! cron's rule: when both are restricted, either may match.

use chrono::{Datelike, Days, NaiveDate, NaiveDateTime, NaiveTime, Timelike};

use crate::InvalidInput;

/// A parsed schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CronSchedule {
    minutes: Vec<u32>,
    hours: Vec<u32>,
    days: Vec<u32>,
    months: Vec<u32>,
    weekdays: Vec<u32>,
    any_day: bool,
    any_weekday: bool,
}

fn field(raw: &str, min: u32, max: u32) -> Option<Vec<u32>> {
    let mut values = Vec::new();
    for part in raw.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((range, step)) => (range, step.parse::<u32>().ok().filter(|s| *s > 0)?),
            None => (part, 1),
        };
        let (from, to) = match range {
            "*" => (min, max),
            r => match r.split_once('-') {
                Some((a, b)) => (a.parse().ok()?, b.parse().ok()?),
                None => {
                    let v = r.parse().ok()?;
                    (v, if part.contains('/') { max } else { v })
                }
            },
        };
        if from < min || to > max || from > to {
            return None;
        }
        values.extend((from..=to).step_by(step as usize));
    }
    values.sort_unstable();
    values.dedup();
    Some(values)
}

impl CronSchedule {
    pub fn parse(raw: &str) -> Result<Self, InvalidInput> {
        let bad = || InvalidInput::UnknownValue {
            field: "cron",
            value: raw.chars().take(64).collect(),
            expected: "five fields: minute hour day-of-month month day-of-week",
        };
        let parts: Vec<&str> = raw.split_whitespace().collect();
        let [minute, hour, day, month, weekday] = parts[..] else { return Err(bad()) };
        let mut weekdays = field(weekday, 0, 7).ok_or_else(bad)?;
        // 7 is Sunday too.
        if weekdays.contains(&7) {
            weekdays.retain(|d| *d != 7);
            weekdays.insert(0, 0);
            weekdays.dedup();
        }
        Ok(Self {
            minutes: field(minute, 0, 59).ok_or_else(bad)?,
            hours: field(hour, 0, 23).ok_or_else(bad)?,
            days: field(day, 1, 31).ok_or_else(bad)?,
            months: field(month, 1, 12).ok_or_else(bad)?,
            weekdays,
            any_day: day == "*",
            any_weekday: weekday == "*",
        })
    }

    fn runs_on(&self, date: NaiveDate) -> bool {
        if !self.months.contains(&date.month()) {
            return false;
        }
        let by_day = self.days.contains(&date.day());
        let by_weekday = self.weekdays.contains(&date.weekday().num_days_from_sunday());
        match (self.any_day, self.any_weekday) {
            (true, true) => true,
            (false, true) => by_day,
            (true, false) => by_weekday,
            (false, false) => by_day || by_weekday,
        }
    }

    /// The latest wall-clock time the schedule fired at or before `now` (wall-clock time in the
    /// same zone), within the last 366 days.
    pub fn last_fire(&self, now: NaiveDateTime) -> Option<NaiveDateTime> {
        let today = now.date();
        for back in 0..=366u64 {
            let date = today.checked_sub_days(Days::new(back))?;
            if !self.runs_on(date) {
                continue;
            }
            let latest = if back == 0 { now.time() } else { NaiveTime::from_hms_opt(23, 59, 59)? };
            let fire = self.hours.iter().rev().find_map(|&h| {
                let minute = self.minutes.iter().rev().find(|&&m| (h, m) <= (latest.hour(), latest.minute()))?;
                NaiveTime::from_hms_opt(h, *minute, 0)
            });
            if let Some(time) = fire {
                return Some(date.and_time(time));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(raw: &str) -> NaiveDateTime {
        NaiveDateTime::parse_from_str(raw, "%Y-%m-%dT%H:%M:%SZ").expect("time")
    }

    #[test]
    fn the_last_fire_is_found_for_common_schedules() {
        let nightly = CronSchedule::parse("0 2 * * *").expect("valid");
        assert_eq!(nightly.last_fire(at("2026-04-02T01:59:00Z")), Some(at("2026-04-01T02:00:00Z")));
        assert_eq!(nightly.last_fire(at("2026-04-02T02:00:30Z")), Some(at("2026-04-02T02:00:00Z")));
        let quarter = CronSchedule::parse("*/15 9-17 * * 1-5").expect("valid");
        // Saturday 2026-04-04: the last fire was Friday 17:45.
        assert_eq!(quarter.last_fire(at("2026-04-04T12:00:00Z")), Some(at("2026-04-03T17:45:00Z")));
        assert_eq!(quarter.last_fire(at("2026-04-03T10:07:00Z")), Some(at("2026-04-03T10:00:00Z")));
        let monthly = CronSchedule::parse("30 3 1 * 0").expect("valid");
        // The 1st, or any Sunday (both restricted: either matches).
        assert_eq!(monthly.last_fire(at("2026-04-03T00:00:00Z")), Some(at("2026-04-01T03:30:00Z")));
        assert_eq!(monthly.last_fire(at("2026-04-06T00:00:00Z")), Some(at("2026-04-05T03:30:00Z")));
        for bad in ["", "0 2 * *", "60 2 * * *", "0 24 * * *", "0 2 0 * *", "*/0 * * * *", "a b c d e", "5-1 * * * *"] {
            assert!(CronSchedule::parse(bad).is_err(), "{bad:?}");
        }
    }
}
