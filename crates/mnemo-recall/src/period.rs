//! The period a question names ("on 13 October 2023", "in July 2023", "last May", "on Monday",
//! "3 days ago", "yesterday"), as event times from one instant to another. Recall ranks that
//! period's rows by meaning as one more list in fusion, so a question about a day finds what was
//! written that day even when neither half ranks it. No model: a few date forms in English. Days
//! are the tenant's (its time zone's "today" and midnights, as for daily notes): the caller turns
//! them into event times. A question naming several periods is read by the first form of `FORMS`
//! it holds: written dates before relative words.

use std::sync::LazyLock;

use chrono::{Datelike, Days, Months, NaiveDate, Weekday};
use regex::{Captures, Regex};

/// Days from `from` (included) to `to` (excluded), in the tenant's calendar.
pub type Period = (NaiveDate, NaiveDate);

const MONTH: &str = r"(january|february|march|april|may|june|july|august|september|october|november|december|jan|feb|mar|apr|jun|jul|aug|sept|sep|oct|nov|dec)\.?";
const DAY: &str = r"([0-9]{1,2})(?:st|nd|rd|th)?";
/// A year a question may name: four digits of this century or the last ("a budget of 4096
/// tokens" names none).
const YEAR: &str = r"((?:19|20)[0-9]{2})";
/// What a number a question gives can count: "in 2000 words" names no year.
const UNIT: &str = r"words?|tokens?|characters?|chars?|letters?|lines?|pages?|items?|bytes?|rows?|messages?|people|users?|points?|steps?|times|dollars?|euros?";

/// The forms read, written dates first. The whole question is searched for each in turn.
#[derive(Clone, Copy)]
enum Form {
    IsoDay,
    MonthDayYear,
    DayMonthYear,
    MonthYear,
    MonthDayLastYear,
    DayMonthLastYear,
    MonthDay,
    DayMonth,
    MonthLastYear,
    Weekday,
    DaysAgo,
    LastMonthNamed,
    MonthNamed,
    Year,
    Relative,
}

static FORMS: LazyLock<Vec<(Form, Regex)>> = LazyLock::new(|| {
    let forms = [
        // A time may follow the day ("2023-10-13T10:00", lowercased).
        (Form::IsoDay, r"\b([0-9]{4})-([0-9]{1,2})-([0-9]{1,2})(?:t|\b)".to_owned()),
        (Form::MonthDayYear, format!(r"\b{MONTH}\s+{DAY},?\s+(?:of\s+)?{YEAR}\b")),
        (Form::DayMonthYear, format!(r"\b{DAY}\s+(?:of\s+)?{MONTH},?\s+(?:of\s+)?{YEAR}\b")),
        (Form::MonthYear, format!(r"\b{MONTH},?\s+(?:of\s+)?{YEAR}\b")),
        (Form::MonthDayLastYear, format!(r"\b{MONTH}\s+{DAY},?\s+(?:of\s+)?last\s+year\b")),
        (Form::DayMonthLastYear, format!(r"\b{DAY}\s+(?:of\s+)?{MONTH},?\s+(?:of\s+)?last\s+year\b")),
        (Form::MonthDay, format!(r"\b{MONTH}\s+{DAY}\b")),
        (Form::DayMonth, format!(r"\b{DAY}\s+(?:of\s+)?{MONTH}\b")),
        // After a preposition, as a month alone: "what may last year's notes say" names none.
        (Form::MonthLastYear, format!(r"\b(?:in|during|of)\s+{MONTH},?\s+(?:of\s+)?last\s+year\b")),
        (Form::Weekday, r"\b(on|last)\s+(monday|tuesday|wednesday|thursday|friday|saturday|sunday)\b".to_owned()),
        (Form::DaysAgo, r"\b([0-9]{1,3})\s+days?\s+ago\b".to_owned()),
        (Form::LastMonthNamed, format!(r"\blast\s+{MONTH}\b")),
        // A month alone only after a preposition: "may" is also a verb.
        // Not a name's possessive after "of" ("one of May's friends"); "in May's first week" is May.
        (Form::MonthNamed, format!(r"\b(?:in|during|(of))\s+{MONTH}\b(['’]s)?")),
        (Form::Year, format!(r"\b(?:in|during|of)\s+{YEAR}\b(?:\s+({UNIT})\b)?")),
        (Form::Relative, r"\b(today|yesterday|last\s+week|last\s+month|last\s+year)\b".to_owned()),
    ];
    forms.into_iter().map(|(form, pattern)| (form, Regex::new(&pattern).expect("period pattern"))).collect()
});

/// Whether `question` holds any form of a period; [`named_period`] says which period, given the
/// day it is asked on. Most questions name none, and need not look up the tenant's day.
pub fn names_a_period(question: &str) -> bool {
    first_match(&question.to_lowercase()).is_some()
}

/// The period `question` names, read as if asked on `today`; `None` when it names none. The
/// first form the question holds decides: a day that does not exist ("31 April 2023") names
/// nothing, not the month around it.
pub fn named_period(question: &str, today: NaiveDate) -> Option<Period> {
    let question = question.to_lowercase();
    let (form, c) = first_match(&question)?;
    read(form, &c, today)
}

/// The first match of the first form the lowercased `question` holds that is a period.
fn first_match(question: &str) -> Option<(Form, Captures<'_>)> {
    FORMS.iter().find_map(|(form, regex)| {
        regex.captures_iter(question).find(|c| !names_something_else(*form, c)).map(|c| (*form, c))
    })
}

/// Whether a match is no period at all: a year followed by what it counts ("in 2000 words"), a
/// month's possessive after "of" (a person named May). The form's next match may be one.
fn names_something_else(form: Form, c: &Captures) -> bool {
    match form {
        Form::Year => c.get(2).is_some(),
        Form::MonthNamed => c.get(1).is_some() && c.get(3).is_some(),
        _ => false,
    }
}

/// The period one form's match names; `None` when no such day exists.
fn read(form: Form, c: &Captures, today: NaiveDate) -> Option<Period> {
    let number = |i: usize| c.get(i)?.as_str().parse::<u32>().ok();
    let year = |i: usize| number(i).and_then(|y| i32::try_from(y).ok());
    let month = |i: usize| month_number(c.get(i)?.as_str());
    match form {
        Form::IsoDay => day(NaiveDate::from_ymd_opt(year(1)?, number(2)?, number(3)?)?),
        Form::MonthDayYear => day(NaiveDate::from_ymd_opt(year(3)?, month(1)?, number(2)?)?),
        Form::DayMonthYear => day(NaiveDate::from_ymd_opt(year(3)?, month(2)?, number(1)?)?),
        Form::MonthYear => whole_month(year(2)?, month(1)?),
        Form::MonthDayLastYear => day(NaiveDate::from_ymd_opt(today.year() - 1, month(1)?, number(2)?)?),
        Form::DayMonthLastYear => day(NaiveDate::from_ymd_opt(today.year() - 1, month(2)?, number(1)?)?),
        Form::MonthDay => day(latest_day(today, month(1)?, number(2)?)?),
        Form::DayMonth => day(latest_day(today, month(2)?, number(1)?)?),
        Form::MonthLastYear => whole_month(today.year() - 1, month(1)?),
        Form::Weekday => {
            let wanted: Weekday = c.get(2)?.as_str().parse().ok()?;
            let mut back = (7 + today.weekday().num_days_from_monday() - wanted.num_days_from_monday()) % 7;
            // "last Monday" asked on a Monday is a week ago; "on Monday" is today.
            if back == 0 && c.get(1)?.as_str() == "last" {
                back = 7;
            }
            day(today.checked_sub_days(Days::new(u64::from(back)))?)
        }
        Form::DaysAgo => day(today.checked_sub_days(Days::new(u64::from(number(1)?)))?),
        Form::LastMonthNamed => {
            let m = month(1)?;
            whole_month(if m < today.month() { today.year() } else { today.year() - 1 }, m)
        }
        Form::MonthNamed => {
            let m = month(2)?;
            whole_month(if m <= today.month() { today.year() } else { today.year() - 1 }, m)
        }
        Form::Year => {
            let y = year(1)?;
            span(NaiveDate::from_ymd_opt(y, 1, 1)?, NaiveDate::from_ymd_opt(y + 1, 1, 1)?)
        }
        Form::Relative => relative(c.get(1)?.as_str(), today),
    }
}

fn month_number(name: &str) -> Option<u32> {
    let name = name.trim_end_matches('.');
    let months = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"];
    months.iter().position(|m| name.starts_with(m)).and_then(|i| u32::try_from(i + 1).ok())
}

fn span(from: NaiveDate, to: NaiveDate) -> Option<Period> {
    Some((from, to))
}

fn day(date: NaiveDate) -> Option<Period> {
    span(date, date.checked_add_days(Days::new(1))?)
}

fn whole_month(year: i32, month: u32) -> Option<Period> {
    let first = NaiveDate::from_ymd_opt(year, month, 1)?;
    span(first, first.checked_add_months(Months::new(1))?)
}

/// The last `month`/`day` on or before `today` ("on May 8" asked in March means last year's).
/// February 29 can be up to eight years back (1896, then 1904).
fn latest_day(today: NaiveDate, month: u32, day: u32) -> Option<NaiveDate> {
    (0..=8).filter_map(|back| NaiveDate::from_ymd_opt(today.year() - back, month, day)).find(|d| *d <= today)
}

fn relative(words: &str, today: NaiveDate) -> Option<Period> {
    let first_of_month = today.with_day(1)?;
    match words.split_whitespace().collect::<Vec<_>>().as_slice() {
        ["today"] => day(today),
        ["yesterday"] => day(today.checked_sub_days(Days::new(1))?),
        ["last", "week"] => span(today.checked_sub_days(Days::new(7))?, today),
        ["last", "month"] => span(first_of_month.checked_sub_months(Months::new(1))?, first_of_month),
        ["last", "year"] => {
            span(NaiveDate::from_ymd_opt(today.year() - 1, 1, 1)?, NaiveDate::from_ymd_opt(today.year(), 1, 1)?)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(y: i32, m: u32, d: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(y, m, d).expect("a date")
    }

    fn named(question: &str) -> Option<Period> {
        let period = named_period(question, at(2023, 10, 20));
        assert_eq!(names_a_period(question), period.is_some() || IMPOSSIBLE.contains(&question), "{question}");
        period
    }

    /// Questions holding a form whose day does not exist.
    const IMPOSSIBLE: [&str; 4] = [
        "What happened on February 30, 2023?",
        "What happened on 31 April 2023?",
        "and on the 31st of April?",
        "What did I write on 2023-13-01?",
    ];

    #[test]
    fn a_named_day_is_that_day_whatever_its_form() {
        let october_13 = Some((at(2023, 10, 13), at(2023, 10, 14)));
        for question in [
            "What painting did Melanie show to Caroline on October 13, 2023?",
            "What happened on 13 October 2023?",
            "and on the 13th of October, 2023?",
            "What did we decide on 2023-10-13?",
            "What did we decide at 2023-10-13T10:00?",
            "Notes from Oct. 13 2023",
            "What did I say on October 13?",
            "WHAT DID I SAY ON 13 OCTOBER?",
        ] {
            assert_eq!(named(question), october_13, "{question}");
        }
    }

    #[test]
    fn months_years_and_relative_words_are_whole_periods() {
        let cases = [
            ("What did Mel paint in July 2023?", (at(2023, 7, 1), at(2023, 8, 1))),
            ("Where did we go in December?", (at(2022, 12, 1), at(2023, 1, 1))),
            ("What did we plan in October?", (at(2023, 10, 1), at(2023, 11, 1))),
            ("What did I buy last May?", (at(2023, 5, 1), at(2023, 6, 1))),
            ("What did I buy last October?", (at(2022, 10, 1), at(2022, 11, 1))),
            ("How often did Melanie go to the beach in 2022?", (at(2022, 1, 1), at(2023, 1, 1))),
            ("What did we talk about yesterday?", (at(2023, 10, 19), at(2023, 10, 20))),
            // A number counted is passed over, for a later year or another form.
            ("In 2000 words, what did we say in 2022?", (at(2022, 1, 1), at(2023, 1, 1))),
            ("What did we write yesterday, in 2000 words?", (at(2023, 10, 19), at(2023, 10, 20))),
            ("What did one of May's friends say in May?", (at(2023, 5, 1), at(2023, 6, 1))),
            ("What did I do in May's first week?", (at(2023, 5, 1), at(2023, 6, 1))),
            ("anything today?", (at(2023, 10, 20), at(2023, 10, 21))),
            ("What changed last week?", (at(2023, 10, 13), at(2023, 10, 20))),
            ("What changed last month?", (at(2023, 9, 1), at(2023, 10, 1))),
            ("What changed last year?", (at(2022, 1, 1), at(2023, 1, 1))),
            ("On December 31 we met", (at(2022, 12, 31), at(2023, 1, 1))),
            ("What did we do on February 29?", (at(2020, 2, 29), at(2020, 3, 1))),
            // 2023-10-20 is a Friday.
            ("What did we say on Monday?", (at(2023, 10, 16), at(2023, 10, 17))),
            ("What did we say on Friday?", (at(2023, 10, 20), at(2023, 10, 21))),
            ("What did we say last Friday?", (at(2023, 10, 13), at(2023, 10, 14))),
            ("What did we say last Saturday?", (at(2023, 10, 14), at(2023, 10, 15))),
            ("What did I log 3 days ago?", (at(2023, 10, 17), at(2023, 10, 18))),
            ("and 1 day ago?", (at(2023, 10, 19), at(2023, 10, 20))),
            // A year named with "of", or as last year; a number elsewhere is no year of the day's.
            ("What happened on March 3rd of 2022?", (at(2022, 3, 3), at(2022, 3, 4))),
            ("What did we do in May of last year?", (at(2022, 5, 1), at(2022, 6, 1))),
            ("and in November last year?", (at(2022, 11, 1), at(2022, 12, 1))),
            ("What did we do on May 5 of last year?", (at(2022, 5, 5), at(2022, 5, 6))),
            ("and on the 5th of May last year?", (at(2022, 5, 5), at(2022, 5, 6))),
            ("What did we decide on May 8? Summarise it in 2000 words.", (at(2023, 5, 8), at(2023, 5, 9))),
            ("What may last year's notes say about the budget?", (at(2022, 1, 1), at(2023, 1, 1))),
        ];
        for (question, period) in cases {
            assert_eq!(named(question), Some(period), "{question}");
        }
    }

    #[test]
    fn the_most_precise_form_wins_and_impossible_dates_name_nothing() {
        assert_eq!(named("In 2023, what did we say on March 3, 2023?"), Some((at(2023, 3, 3), at(2023, 3, 4))));
        for question in [
            "What did Caroline research?",
            "I think this may go later",
            "Set the limit to 2000 words",
            "Keep it to a budget of 4096 tokens",
            "Summarise our plan in 2000 words",
            "What fits in a context of 2048 tokens?",
            "What did one of May's friends say?",
            "What did one of May’s friends say?",
            "Which march did Caroline join?",
        ]
        .into_iter()
        .chain(IMPOSSIBLE)
        {
            assert_eq!(named(question), None, "{question}");
        }
    }
}
