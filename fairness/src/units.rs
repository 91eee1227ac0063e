//! Kubernetes resource quantities, Go-style durations, and the human forms of
//! milli-GPUe and milliseconds.
//!
//! Everything here is exact integer arithmetic on the digits of the input: no floats,
//! no platform maths, so every node of the control plane parses `"1.5"` and `"0.1Ki"`
//! to the same thousandths. No function here panics, whatever string it is given.

use thiserror::Error;

/// The longest quantity string [`parse_quantity_milli`] accepts, in bytes.
///
/// Real pod specs never come close (`"18446744073709551615m"` is 21 characters); the
/// limit only stops absurd inputs early.
pub const MAX_QUANTITY_LEN: usize = 64;

/// The largest decimal exponent magnitude accepted in `e<int>` / `E<int>` quantity
/// suffixes (the exponent must fit a signed 32-bit integer, as Kubernetes' decimal
/// scale does).
pub const MAX_QUANTITY_EXPONENT: i64 = i32::MAX as i64;

/// What [`parse_quantity_milli`] accepts after the number, for error messages.
const ACCEPTED_SUFFIXES: &str = "no suffix, decimal n u m k M G T P E, binary Ki Mi Gi Ti Pi Ei, \
     or a decimal exponent such as e3 or E-3";

/// What [`parse_duration_ms`] accepts as units, for error messages.
const ACCEPTED_UNITS: &str = "ms, s, m, h, d (d = 24h)";

/// Why a Kubernetes resource quantity string was rejected by [`parse_quantity_milli`].
///
/// Every message says what was wrong and what is accepted instead.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum QuantityError {
    /// The string was empty.
    #[error("empty quantity: give a number such as \"1\", \"500m\", \"1.5\" or \"2Gi\"")]
    Empty,
    /// The string is longer than [`MAX_QUANTITY_LEN`] bytes.
    #[error("quantity is {len} characters long; at most {max} are accepted")]
    TooLong {
        /// Length of the rejected input, in bytes.
        len: usize,
        /// The limit, [`MAX_QUANTITY_LEN`].
        max: usize,
    },
    /// The string contains whitespace (Kubernetes rejects surrounding spaces too).
    #[error("quantity {input:?} contains whitespace; write it without spaces, e.g. \"500m\" or \"2Gi\"")]
    Whitespace {
        /// The rejected input.
        input: String,
    },
    /// The value is below zero.
    #[error("quantity {input:?} is negative; only zero or positive quantities are accepted")]
    Negative {
        /// The rejected input.
        input: String,
    },
    /// The numeric part is missing or malformed.
    #[error(
        "quantity {input:?} has no valid number ({reason}); expected an optional sign, then digits \
         with an optional fraction, e.g. \"2\", \"1.5\", \".5\" or \"+1\", then a suffix"
    )]
    BadNumber {
        /// The rejected input.
        input: String,
        /// What exactly was wrong with the number.
        reason: &'static str,
    },
    /// The text after the number is not a known suffix.
    #[error("quantity {input:?} has unknown suffix {suffix:?}; accepted: {accepted}", accepted = ACCEPTED_SUFFIXES)]
    UnknownSuffix {
        /// The rejected input.
        input: String,
        /// The unrecognised suffix.
        suffix: String,
    },
    /// The value in thousandths does not fit an unsigned 64-bit integer.
    #[error(
        "quantity {input:?} is too large: at most {max} thousandths (about 18.4 quadrillion units, \
         e.g. \"18P\" or \"16Pi\") are accepted",
        max = u64::MAX
    )]
    TooLarge {
        /// The rejected input.
        input: String,
    },
    /// The `e<int>` exponent has too many digits or is out of range.
    #[error(
        "quantity {input:?} has exponent {exponent:?} out of range; the exponent must be an \
         integer between -{max} and {max}",
        max = MAX_QUANTITY_EXPONENT
    )]
    ExponentOutOfRange {
        /// The rejected input.
        input: String,
        /// The digits of the exponent as written (with its sign, if any).
        exponent: String,
    },
}

/// Why a duration string was rejected by [`parse_duration_ms`].
///
/// Every message says what was wrong and what is accepted instead.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DurationError {
    /// The string was empty.
    #[error("empty duration: give a number with a unit, e.g. \"24h\", \"1h30m\" or \"500ms\"")]
    Empty,
    /// A number is not followed by a unit (e.g. `"86400"`).
    #[error(
        "duration {input:?} has a number without a unit; add a unit, e.g. \"24h\" \
         (accepted units: {units})",
        units = ACCEPTED_UNITS
    )]
    MissingUnit {
        /// The rejected input.
        input: String,
    },
    /// A number is followed by something that is not a known unit.
    #[error("duration {input:?} has unknown unit {unit:?}; accepted units: {units}", units = ACCEPTED_UNITS)]
    UnknownUnit {
        /// The rejected input.
        input: String,
        /// The unrecognised unit.
        unit: String,
    },
    /// The duration is below zero.
    #[error("duration {input:?} is negative; only zero or positive durations are accepted")]
    Negative {
        /// The rejected input.
        input: String,
    },
    /// A number is missing or malformed where one was expected.
    #[error(
        "duration {input:?} has no valid number ({reason}); expected parts like \"1h\", \"30m\", \
         \"1.5s\" or \"500ms\", one after the other"
    )]
    BadNumber {
        /// The rejected input.
        input: String,
        /// What exactly was wrong with the number.
        reason: &'static str,
    },
    /// The total in milliseconds does not fit an unsigned 64-bit integer.
    #[error(
        "duration {input:?} is too long: at most {max} ms (about 584 million years) is accepted",
        max = u64::MAX
    )]
    Overflow {
        /// The rejected input.
        input: String,
    },
}

/// A non-negative decimal integer as base-10 digits, least significant first.
///
/// Only ever holds values `0..=9` per element; used so that quantity and duration
/// arithmetic is exact for any number of digits the input may carry.
#[derive(Clone, Debug, Default)]
struct Digits(Vec<u32>);

impl Digits {
    /// The digits of `int` followed by those of `frac` (both ASCII-digit strings),
    /// read as one integer.
    fn from_ascii(int: &str, frac: &str) -> Self {
        let digits = int
            .bytes()
            .chain(frac.bytes())
            .rev()
            .map(|b| u32::from(b.wrapping_sub(b'0')) % 10)
            .collect();
        Digits(digits)
    }

    /// Multiplies in place by `factor`.
    fn mul_small(&mut self, factor: u32) {
        let mut carry: u64 = 0;
        for d in &mut self.0 {
            let v = u64::from(*d) * u64::from(factor) + carry;
            *d = low_digit(v);
            carry = v / 10;
        }
        while carry > 0 {
            self.0.push(low_digit(carry));
            carry /= 10;
        }
    }

    /// Drops the `n` least significant digits (integer division by `10^n`), and says
    /// whether any dropped digit was non-zero (the division had a remainder).
    fn shift_down(&mut self, n: usize) -> bool {
        let n = n.min(self.0.len());
        let remainder = self.0.iter().take(n).any(|&d| d != 0);
        self.0.drain(..n);
        remainder
    }

    /// Whether the value is zero.
    fn is_zero(&self) -> bool {
        self.0.iter().all(|&d| d == 0)
    }

    /// The number of digits without leading zeros (0 for zero).
    fn significant_len(&self) -> usize {
        self.0.iter().rposition(|&d| d != 0).map_or(0, |p| p + 1)
    }

    /// The value as `u64`, or `None` if it does not fit.
    fn to_u64(&self) -> Option<u64> {
        self.0
            .iter()
            .rev()
            .try_fold(0u64, |acc, &d| acc.checked_mul(10)?.checked_add(u64::from(d)))
    }
}

/// `v % 10` as a digit, without a narrowing cast.
fn low_digit(v: u64) -> u32 {
    match v % 10 {
        0 => 0,
        1 => 1,
        2 => 2,
        3 => 3,
        4 => 4,
        5 => 5,
        6 => 6,
        7 => 7,
        8 => 8,
        _ => 9,
    }
}

/// The scale a quantity suffix applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scale {
    /// Multiply by `10^exp`.
    Decimal(i64),
    /// Multiply by `1024^power`.
    Binary(u32),
}

/// Interprets the text after a quantity's number.
fn parse_suffix(input: &str, suffix: &str) -> Result<Scale, QuantityError> {
    let scale = match suffix {
        "" => Scale::Decimal(0),
        "n" => Scale::Decimal(-9),
        "u" => Scale::Decimal(-6),
        "m" => Scale::Decimal(-3),
        "k" => Scale::Decimal(3),
        "M" => Scale::Decimal(6),
        "G" => Scale::Decimal(9),
        "T" => Scale::Decimal(12),
        "P" => Scale::Decimal(15),
        // A lone "E" is exa; "E" followed by digits is an exponent (handled below).
        "E" => Scale::Decimal(18),
        "Ki" => Scale::Binary(1),
        "Mi" => Scale::Binary(2),
        "Gi" => Scale::Binary(3),
        "Ti" => Scale::Binary(4),
        "Pi" => Scale::Binary(5),
        "Ei" => Scale::Binary(6),
        _ => return parse_exponent(input, suffix).map(Scale::Decimal),
    };
    Ok(scale)
}

/// Interprets `e<int>` / `E<int>` (the int may carry a sign).
fn parse_exponent(input: &str, suffix: &str) -> Result<i64, QuantityError> {
    let unknown = || QuantityError::UnknownSuffix {
        input: input.to_owned(),
        suffix: suffix.to_owned(),
    };
    let exponent = suffix
        .strip_prefix('e')
        .or_else(|| suffix.strip_prefix('E'))
        .ok_or_else(unknown)?;
    let (negative, digits) = match exponent.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, exponent.strip_prefix('+').unwrap_or(exponent)),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(unknown());
    }
    let out_of_range = || QuantityError::ExponentOutOfRange {
        input: input.to_owned(),
        exponent: exponent.to_owned(),
    };
    let magnitude = Digits::from_ascii(digits, "")
        .to_u64()
        .and_then(|m| i64::try_from(m).ok())
        .filter(|&m| m <= MAX_QUANTITY_EXPONENT)
        .ok_or_else(out_of_range)?;
    Ok(if negative { -magnitude } else { magnitude })
}

/// Parses a Kubernetes resource quantity (as written in a pod spec) into thousandths
/// of its unit, rounding up like Kubernetes' `Quantity.MilliValue()`.
///
/// Holds: `"1"` -> 1000, `"500m"` -> 500, `"1.5"` -> 1500, `"2k"` -> 2_000_000,
/// `"1Ki"` -> 1_024_000, `"1e3"` -> 1_000_000, `"1E-3"` -> 1, `"100u"` -> 1,
/// `"0.0001"` -> 1, `"+1"` -> 1000. Any value with a non-zero part below one
/// thousandth rounds up to the next thousandth; the result is exact otherwise.
///
/// Grammar: an optional sign `+`/`-`, then digits with an optional `.` fraction (at
/// least one digit overall: `"1."` and `".5"` are fine), then exactly one suffix:
/// binary `Ki Mi Gi Ti Pi Ei`, decimal `n u m k M G T P E` or none, or a decimal
/// exponent `e<int>` / `E<int>` (a lone `E` is exa). `"-0"` is zero; any other
/// negative value is an error.
///
/// # Errors
/// [`QuantityError`]: empty input, input over [`MAX_QUANTITY_LEN`] bytes, any
/// whitespace, a negative value, a missing or malformed number, an unknown suffix, an
/// exponent out of range, or a value whose thousandths do not fit `u64`.
pub fn parse_quantity_milli(s: &str) -> Result<u64, QuantityError> {
    match plain_quantity_milli(s) {
        Some(v) => Ok(v),
        None => parse_quantity_milli_general(s),
    }
}

/// The quantities pods carry nearly always (`"1"`, `"500m"`, `"32Gi"`, `"4k"`): up to
/// 15 ASCII digits and at most one common suffix, read in `u64` without allocating.
/// `None` for anything else (a sign, a fraction, an exponent, a rarer suffix, an
/// overflow), which [`parse_quantity_milli_general`] then reads; both give the same
/// answer wherever this one answers (a property test checks it).
fn plain_quantity_milli(s: &str) -> Option<u64> {
    let b = s.as_bytes();
    let digits = b.iter().take_while(|c| c.is_ascii_digit()).count();
    if digits == 0 || digits > 15 {
        return None;
    }
    let mut int: u64 = 0;
    for c in &b[..digits] {
        int = int * 10 + u64::from(c - b'0');
    }
    let milli_per_unit: u64 = match &b[digits..] {
        b"" => 1_000,
        b"m" => return Some(int),
        b"k" => 1_000_000,
        b"M" => 1_000_000_000,
        b"G" => 1_000_000_000_000,
        b"Ki" => 1_024_000,
        b"Mi" => 1_048_576_000,
        b"Gi" => 1_073_741_824_000,
        b"Ti" => 1_099_511_627_776_000,
        _ => return None,
    };
    int.checked_mul(milli_per_unit)
}

fn parse_quantity_milli_general(s: &str) -> Result<u64, QuantityError> {
    if s.is_empty() {
        return Err(QuantityError::Empty);
    }
    if s.len() > MAX_QUANTITY_LEN {
        return Err(QuantityError::TooLong {
            len: s.len(),
            max: MAX_QUANTITY_LEN,
        });
    }
    if s.chars().any(char::is_whitespace) {
        return Err(QuantityError::Whitespace { input: s.to_owned() });
    }
    let bad_number = |reason| QuantityError::BadNumber {
        input: s.to_owned(),
        reason,
    };

    let (negative, unsigned) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };

    // The number is the leading run of ASCII digits and dots; the rest is the suffix.
    // The run is ASCII, so its end is a char boundary.
    let number_len = unsigned
        .bytes()
        .take_while(|b| b.is_ascii_digit() || *b == b'.')
        .count();
    let (number, suffix) = unsigned.split_at(number_len);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if frac.contains('.') {
        return Err(bad_number("more than one decimal point"));
    }
    if int.is_empty() && frac.is_empty() {
        return Err(bad_number(if number.is_empty() {
            "no digits before the suffix"
        } else {
            "a decimal point needs at least one digit"
        }));
    }

    let scale = parse_suffix(s, suffix)?;
    let mut digits = Digits::from_ascii(int, frac);
    if negative && !digits.is_zero() {
        return Err(QuantityError::Negative { input: s.to_owned() });
    }

    // value = digits * 10^(exp10 - frac_len) * 1024^binary, in thousandths: * 10^3.
    let frac_len = i64::try_from(frac.len()).unwrap_or(i64::MAX);
    let exp10 = match scale {
        Scale::Decimal(exp) => exp,
        Scale::Binary(power) => {
            for _ in 0..power {
                digits.mul_small(1024);
            }
            0
        }
    };
    let shift = exp10.saturating_add(3).saturating_sub(frac_len);
    scaled_to_u64(digits, shift).ok_or_else(|| QuantityError::TooLarge { input: s.to_owned() })
}

/// `ceil(digits * 10^shift)` as `u64`, or `None` if it does not fit.
fn scaled_to_u64(mut digits: Digits, shift: i64) -> Option<u64> {
    let len = digits.significant_len();
    if len == 0 {
        return Some(0);
    }
    if shift >= 0 {
        // The value is at least 10^(len - 1 + shift); u64::MAX < 10^20.
        let len = i64::try_from(len).unwrap_or(i64::MAX);
        if len.saturating_add(shift) > 20 {
            return None;
        }
        let mut value = digits.to_u64()?;
        for _ in 0..shift {
            value = value.checked_mul(10)?;
        }
        Some(value)
    } else {
        let drop = usize::try_from(shift.unsigned_abs()).unwrap_or(usize::MAX);
        if drop >= len {
            // Strictly between 0 and 1: rounds up to one thousandth.
            return Some(1);
        }
        let remainder = digits.shift_down(drop);
        digits.to_u64()?.checked_add(u64::from(remainder))
    }
}

/// Milliseconds in one duration unit, or `None` for an unknown unit.
fn unit_ms(unit: &str) -> Option<u32> {
    match unit {
        "ms" => Some(1),
        "s" => Some(1_000),
        "m" => Some(60_000),
        "h" => Some(3_600_000),
        "d" => Some(86_400_000),
        _ => None,
    }
}

/// Parses a Go-style duration as written in Kubernetes YAML into milliseconds.
///
/// Holds: `"24h"` -> 86_400_000, `"1h30m"` -> 5_400_000, `"90s"` -> 90_000,
/// `"500ms"` -> 500, `"1.5h"` -> 5_400_000, `"2d"` -> 172_800_000, `"0s"` -> 0.
///
/// Grammar: an optional sign, then one or more `<number><unit>` parts; a number is
/// digits with an optional `.` fraction (`"1.5s"`, `".5s"`, `"1.s"`); units are
/// `ms s m h d` (`d` = 24h, an extension to Go). Each part's fraction is truncated
/// toward zero at millisecond precision, exactly (no floats); the parts are summed.
/// As in Go, a bare `"0"` is accepted as zero; any other number needs a unit. `"-0s"`
/// is zero; any other negative duration is an error.
///
/// # Errors
/// [`DurationError`]: empty input, a number without a unit (e.g. `"86400"`), an
/// unknown unit, a missing or malformed number, a negative duration, or a total that
/// does not fit `u64` milliseconds.
pub fn parse_duration_ms(s: &str) -> Result<u64, DurationError> {
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    let (negative, unsigned) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    if unsigned == "0" {
        return Ok(0);
    }
    let result = parse_unsigned_duration(s, unsigned);
    if !negative {
        return result;
    }
    match result {
        Ok(0) => Ok(0),
        Ok(_) | Err(DurationError::Overflow { .. }) => Err(DurationError::Negative { input: s.to_owned() }),
        Err(e) => Err(e),
    }
}

/// Sums the `<number><unit>` parts of `body` (the input without its sign).
fn parse_unsigned_duration(input: &str, body: &str) -> Result<u64, DurationError> {
    let bad_number = |reason| DurationError::BadNumber {
        input: input.to_owned(),
        reason,
    };
    let overflow = || DurationError::Overflow {
        input: input.to_owned(),
    };
    if body.is_empty() {
        return Err(bad_number("nothing after the sign"));
    }

    let mut rest = body;
    let mut total_ms: u64 = 0;
    while !rest.is_empty() {
        // Number: digits, optionally '.', digits. All ASCII, so the splits below are
        // on char boundaries.
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let (int, after_int) = rest.split_at(int_len);
        let (frac, after_number) = match after_int.strip_prefix('.') {
            Some(after_dot) => {
                let frac_len = after_dot.bytes().take_while(u8::is_ascii_digit).count();
                after_dot.split_at(frac_len)
            }
            None => ("", after_int),
        };
        if int.is_empty() && frac.is_empty() {
            return Err(bad_number(if after_int.starts_with('.') {
                "a decimal point needs at least one digit"
            } else {
                "expected a number before each unit"
            }));
        }

        // Unit: everything up to the next digit or '.', or the end.
        let unit_len = after_number
            .bytes()
            .take_while(|b| !b.is_ascii_digit() && *b != b'.')
            .count();
        let (unit, after_unit) = after_number.split_at(unit_len);
        if unit.is_empty() {
            return Err(if after_unit.is_empty() {
                DurationError::MissingUnit {
                    input: input.to_owned(),
                }
            } else {
                bad_number("more than one decimal point in a number")
            });
        }
        let per_unit_ms = unit_ms(unit).ok_or_else(|| DurationError::UnknownUnit {
            input: input.to_owned(),
            unit: unit.to_owned(),
        })?;

        total_ms = part_ms(int, frac, per_unit_ms)
            .and_then(|part| total_ms.checked_add(part))
            .ok_or_else(overflow)?;
        rest = after_unit;
    }
    Ok(total_ms)
}

/// `<int>.<frac>` units of `per_unit_ms` each, in ms (the fraction floored, exactly);
/// `None` on overflow.
fn part_ms(int: &str, frac: &str, per_unit_ms: u32) -> Option<u64> {
    let int_ms = Digits::from_ascii(int, "")
        .to_u64()
        .and_then(|v| v.checked_mul(u64::from(per_unit_ms)))?;
    // floor(0.<frac> * per_unit_ms), exactly.
    let mut frac_digits = Digits::from_ascii(frac, "");
    frac_digits.mul_small(per_unit_ms);
    frac_digits.shift_down(frac.len());
    int_ms.checked_add(frac_digits.to_u64()?)
}

/// `whole` followed by `.` and the thousandths `frac_milli` (0..1000) without trailing
/// zeros; just `whole` when `frac_milli` is zero.
fn with_thousandths(whole: u64, frac_milli: u64) -> String {
    if frac_milli == 0 {
        return whole.to_string();
    }
    let frac = format!("{frac_milli:03}");
    format!("{whole}.{}", frac.trim_end_matches('0'))
}

/// Formats milli-GPUe (or any thousandths) as a plain decimal without trailing zeros.
///
/// Holds: 1000 -> `"1"`, 1500 -> `"1.5"`, 143 -> `"0.143"`, 0 -> `"0"`,
/// 12340 -> `"12.34"`. The output is a valid quantity: `parse_quantity_milli` of it
/// gives back the input, for every `u64`.
#[must_use]
pub fn format_gpue(milli: crate::MilliGpue) -> String {
    with_thousandths(milli / 1000, milli % 1000)
}

/// [`format_gpue`]'s text, written by `Display` without a `String` of its own: for
/// messages built with `format!` on a hot path (admission decisions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpue(pub crate::MilliGpue);

impl std::fmt::Display for Gpue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (whole, frac) = (self.0 / 1000, self.0 % 1000);
        // Thousandths without trailing zeros, as format_gpue trims them.
        if frac == 0 {
            write!(f, "{whole}")
        } else if frac % 100 == 0 {
            write!(f, "{whole}.{}", frac / 100)
        } else if frac % 10 == 0 {
            write!(f, "{whole}.{:02}", frac / 10)
        } else {
            write!(f, "{whole}.{frac:03}")
        }
    }
}

/// Formats milliseconds as a compact Go-style duration.
///
/// Holds: 0 -> `"0s"`, 250 -> `"250ms"`, 1500 -> `"1.5s"`, 90_000 -> `"1m30s"`,
/// 86_400_000 -> `"24h"`, 3_723_000 -> `"1h2m3s"`. Below one second the unit is `ms`;
/// otherwise hours, minutes and (possibly fractional) seconds, leaving out zero parts
/// and never using days. `parse_duration_ms` of the output gives back the input.
#[must_use]
pub fn format_duration_ms(ms: crate::Millis) -> String {
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = (ms % 3_600_000) / 60_000;
    let seconds_ms = ms % 60_000;
    let mut out = String::new();
    if hours > 0 {
        out.push_str(&hours.to_string());
        out.push('h');
    }
    if minutes > 0 {
        out.push_str(&minutes.to_string());
        out.push('m');
    }
    if seconds_ms > 0 {
        out.push_str(&with_thousandths(seconds_ms / 1000, seconds_ms % 1000));
        out.push('s');
    }
    out
}

/// Formats milliseconds since the Unix epoch as an RFC 3339 time in UTC, to the second
/// (`2026-12-07T04:50:53Z`): how the audit log and refusals name an instant of the
/// control plane's clock. The calendar is the proleptic Gregorian one, computed from the
/// day count with integers only (no clock, no time-zone data).
#[must_use]
pub fn format_unix_ms(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Year, month (1-12) and day (1-31) of the day `days` after 1970-01-01: days counted
/// in 400-year eras of 146,097 days from 0000-03-01, so February comes last in a year.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_times_format_as_rfc_3339() {
        assert_eq!(format_unix_ms(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_unix_ms(86_999), "1970-01-01T00:01:26Z");
        assert_eq!(format_unix_ms(1_796_086_800_000), "2026-12-01T01:00:00Z");
        assert_eq!(format_unix_ms(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(format_unix_ms(4_107_542_399_999), "2100-02-28T23:59:59Z");
        assert_eq!(format_unix_ms(4_107_542_400_000), "2100-03-01T00:00:00Z");
        assert_eq!(format_unix_ms(1_704_067_199_000), "2023-12-31T23:59:59Z");
    }
    use proptest::prelude::*;

    #[test]
    fn quantities_parse_to_thousandths_rounded_up() {
        let cases: &[(&str, u64)] = &[
            // The examples from pod specs.
            ("1", 1_000),
            ("2", 2_000),
            ("500m", 500),
            ("1.5", 1_500),
            ("2k", 2_000_000),
            ("1Ki", 1_024_000),
            ("1e3", 1_000_000),
            ("1E-3", 1),
            ("0.1", 100),
            ("100u", 1),
            ("1n", 1),
            ("+1", 1_000),
            ("1u", 1),
            ("0.0001", 1),
            // Zero in every spelling.
            ("0", 0),
            ("0m", 0),
            ("0.000", 0),
            ("-0", 0),
            ("+0Gi", 0),
            ("0e99999", 0),
            // Number forms.
            ("1.", 1_000),
            (".5", 500),
            ("007", 7_000),
            ("1500m", 1_500),
            ("1.0005", 1_001),
            ("0.9999m", 1),
            ("1.999m", 2),
            ("123456789.123", 123_456_789_123),
            ("0.00000000000000000000000000000000000000000000000000001", 1),
            // Decimal suffixes.
            ("1m", 1),
            ("1k", 1_000_000),
            ("1M", 1_000_000_000),
            ("1G", 1_000_000_000_000),
            ("1T", 1_000_000_000_000_000),
            ("1P", 1_000_000_000_000_000_000),
            ("18P", 18_000_000_000_000_000_000),
            ("0.001E", 1_000_000_000_000_000_000),
            ("1500n", 1),
            ("1000000n", 1),
            ("1000001n", 2),
            // Binary suffixes.
            ("1Mi", 1_048_576_000),
            ("1Gi", 1_073_741_824_000),
            ("1.5Gi", 1_610_612_736_000),
            ("0.5Ki", 512_000),
            ("0.1Ki", 102_400),
            ("0.0001Ki", 103),
            ("1Ti", 1_099_511_627_776_000),
            ("1Pi", 1_125_899_906_842_624_000),
            ("16Pi", 18_014_398_509_481_984_000),
            ("0.001Ei", 1_152_921_504_606_846_976),
            // Exponents.
            ("1e0", 1_000),
            ("1e+3", 1_000_000),
            ("1E3", 1_000_000),
            ("1.5e3", 1_500_000),
            (".5e1", 5_000),
            ("5e-4", 1),
            ("1e-100", 1),
            ("25e-3", 25),
            // The edge of u64.
            ("18446744073709551.615", u64::MAX),
            ("18446744073709551615m", u64::MAX),
            ("18446744073709551614.5m", u64::MAX),
        ];
        for &(input, want) in cases {
            assert_eq!(parse_quantity_milli(input), Ok(want), "input {input:?}");
        }
    }

    fn bad_number(input: &str) -> bool {
        matches!(parse_quantity_milli(input), Err(QuantityError::BadNumber { .. }))
    }

    #[test]
    fn quantity_errors_are_distinct_and_specific() {
        assert_eq!(parse_quantity_milli(""), Err(QuantityError::Empty));

        let long = "1".repeat(65);
        assert_eq!(
            parse_quantity_milli(&long),
            Err(QuantityError::TooLong { len: 65, max: 64 })
        );
        assert!(parse_quantity_milli(&"1".repeat(64)).is_err_and(|e| matches!(e, QuantityError::TooLarge { .. })));

        for input in [" 1", "1 ", "1 Gi", "\t500m", "1\n", "1\u{a0}"] {
            assert_eq!(
                parse_quantity_milli(input),
                Err(QuantityError::Whitespace {
                    input: input.to_owned()
                }),
                "input {input:?}"
            );
        }

        for input in ["-1", "-500m", "-0.001", "-1Ki", "-1e30"] {
            assert_eq!(
                parse_quantity_milli(input),
                Err(QuantityError::Negative {
                    input: input.to_owned()
                }),
                "input {input:?}"
            );
        }

        for input in [
            "abc", ".", "+", "-", "m", "Ki", "--1", "+-1", "1.2.3", "1..", "..5", ".m", "e3",
        ] {
            assert!(bad_number(input), "input {input:?}: {:?}", parse_quantity_milli(input));
        }

        for (input, suffix) in [
            ("1K", "K"),
            ("1Gb", "Gb"),
            ("1e", "e"),
            ("1ki", "ki"),
            ("1mi", "mi"),
            ("1e3.5", "e3.5"),
            ("1e+-3", "e+-3"),
            ("1E+", "E+"),
            ("1x", "x"),
            ("1mm", "mm"),
            ("5%", "%"),
            ("1é", "é"),
        ] {
            assert_eq!(
                parse_quantity_milli(input),
                Err(QuantityError::UnknownSuffix {
                    input: input.to_owned(),
                    suffix: suffix.to_owned()
                }),
                "input {input:?}"
            );
        }

        for input in [
            "1E",
            "19P",
            "1Ei",
            "1e20",
            "1e99999",
            "18446744073709551.616",
            "18446744073709551615.5m",
            "99999999999999999999999",
        ] {
            assert_eq!(
                parse_quantity_milli(input),
                Err(QuantityError::TooLarge {
                    input: input.to_owned()
                }),
                "input {input:?}"
            );
        }

        for (input, exponent) in [
            ("1e99999999999", "99999999999"),
            ("1E-2147483648", "-2147483648"),
            ("1e+2147483648", "+2147483648"),
            ("0e99999999999999999999999", "99999999999999999999999"),
        ] {
            assert_eq!(
                parse_quantity_milli(input),
                Err(QuantityError::ExponentOutOfRange {
                    input: input.to_owned(),
                    exponent: exponent.to_owned()
                }),
                "input {input:?}"
            );
        }
        // Leading zeros do not put an exponent out of range: e0...01 is e1.
        assert_eq!(
            parse_quantity_milli("1e00000000000000000000000000000000000000001"),
            Ok(10_000)
        );
        assert_eq!(parse_quantity_milli("1E-2147483647"), Ok(1));
    }

    #[test]
    fn quantity_error_messages_say_what_is_accepted() {
        let unknown = parse_quantity_milli("1Gb").map_err(|e| e.to_string());
        let Err(msg) = unknown else {
            panic!("\"1Gb\" parsed");
        };
        assert!(msg.contains("\"Gb\""), "{msg}");
        assert!(msg.contains("Gi") && msg.contains("e3"), "{msg}");

        let Err(msg) = parse_quantity_milli("-1").map_err(|e| e.to_string()) else {
            panic!("\"-1\" parsed");
        };
        assert!(msg.contains("negative"), "{msg}");
    }

    #[test]
    fn durations_parse_to_milliseconds() {
        let cases: &[(&str, u64)] = &[
            ("24h", 86_400_000),
            ("1h30m", 5_400_000),
            ("90s", 90_000),
            ("500ms", 500),
            ("1.5h", 5_400_000),
            ("2d", 172_800_000),
            ("0s", 0),
            ("0", 0),
            ("+0", 0),
            ("-0", 0),
            ("-0s", 0),
            ("-0.0h0ms", 0),
            ("+5s", 5_000),
            ("1.5s", 1_500),
            ("1m30s", 90_000),
            ("1h2m3s", 3_723_000),
            ("1d12h", 129_600_000),
            ("1h1h", 7_200_000),
            ("30m1h", 5_400_000),
            (".5s", 500),
            ("1.s", 1_000),
            ("0.0005s", 0),
            ("1.9999ms", 1),
            ("0.001s", 1),
            ("0.0019s", 1),
            // 1/60000 of a minute is exactly 1 ms; truncating digits early would give 0.
            ("0.00001666666666666666666666666666666666666667m", 1),
            ("0.0000166m", 0),
            ("00000000000000000000000000000001s", 1_000),
            ("213503982334d", 18_446_744_073_657_600_000),
            ("18446744073709551615ms", u64::MAX),
        ];
        for &(input, want) in cases {
            assert_eq!(parse_duration_ms(input), Ok(want), "input {input:?}");
        }
    }

    #[test]
    fn duration_errors_are_distinct_and_specific() {
        assert_eq!(parse_duration_ms(""), Err(DurationError::Empty));

        for input in ["86400", "1h30", "00", "1.5", "+5"] {
            assert_eq!(
                parse_duration_ms(input),
                Err(DurationError::MissingUnit {
                    input: input.to_owned()
                }),
                "input {input:?}"
            );
        }
        let msg = DurationError::MissingUnit {
            input: "86400".to_owned(),
        }
        .to_string();
        assert!(msg.contains("add a unit, e.g. \"24h\""), "{msg}");

        for (input, unit) in [
            ("5x", "x"),
            ("5sec", "sec"),
            ("5us", "us"),
            ("5ns", "ns"),
            ("1w", "w"),
            ("1h ", "h "),
            ("1H", "H"),
            ("1h-30m", "h-"),
            ("1µs", "µs"),
        ] {
            assert_eq!(
                parse_duration_ms(input),
                Err(DurationError::UnknownUnit {
                    input: input.to_owned(),
                    unit: unit.to_owned()
                }),
                "input {input:?}"
            );
        }
        let msg = parse_duration_ms("5sec").map_err(|e| e.to_string());
        assert!(msg.is_err_and(|m| m.contains("\"sec\"") && m.contains("ms, s, m, h, d")));

        for input in ["-5s", "-1h30m", "-0.001s", "-99999999999999999999d"] {
            assert_eq!(
                parse_duration_ms(input),
                Err(DurationError::Negative {
                    input: input.to_owned()
                }),
                "input {input:?}"
            );
        }

        for input in [
            "h", "ms", "-", "+", "--1s", " 1h", ".s", ".", "1.2.3s", "1h.m", "1h..5m",
        ] {
            assert!(
                matches!(parse_duration_ms(input), Err(DurationError::BadNumber { .. })),
                "input {input:?}: {:?}",
                parse_duration_ms(input)
            );
        }

        for input in [
            "99999999999999999999s",
            "213503982335d",
            "213503982334d1d",
            "18446744073709551616ms",
            "18446744073709551615ms1ms",
        ] {
            assert_eq!(
                parse_duration_ms(input),
                Err(DurationError::Overflow {
                    input: input.to_owned()
                }),
                "input {input:?}"
            );
        }
    }

    #[test]
    fn gpue_formats_without_trailing_zeros() {
        let cases: &[(u64, &str)] = &[
            (1000, "1"),
            (1500, "1.5"),
            (143, "0.143"),
            (0, "0"),
            (12340, "12.34"),
            (1, "0.001"),
            (10, "0.01"),
            (100, "0.1"),
            (1001, "1.001"),
            (2_000_000, "2000"),
            (u64::MAX, "18446744073709551.615"),
        ];
        for &(milli, want) in cases {
            assert_eq!(format_gpue(milli), want, "milli {milli}");
        }
    }

    #[test]
    fn durations_format_compactly() {
        let cases: &[(u64, &str)] = &[
            (0, "0s"),
            (1, "1ms"),
            (250, "250ms"),
            (999, "999ms"),
            (1000, "1s"),
            (1500, "1.5s"),
            (1050, "1.05s"),
            (90_000, "1m30s"),
            (60_000, "1m"),
            (60_250, "1m0.25s"),
            (86_400_000, "24h"),
            (172_800_000, "48h"),
            (3_723_000, "1h2m3s"),
            (3_600_500, "1h0.5s"),
            (3_660_000, "1h1m"),
        ];
        for &(ms, want) in cases {
            assert_eq!(format_duration_ms(ms), want, "ms {ms}");
        }
    }

    proptest! {
        #[test]
        fn gpue_display_is_format_gpue(milli in prop_oneof![any::<u64>(), 0u64..10_000, Just(u64::MAX)]) {
            prop_assert_eq!(Gpue(milli).to_string(), format_gpue(milli));
        }

        #[test]
        fn formatted_gpue_parses_back(milli in 0u64..1_000_000_000_000_000) {
            prop_assert_eq!(parse_quantity_milli(&format_gpue(milli)), Ok(milli));
            prop_assert_eq!(parse_quantity_milli(&format!("{milli}m")), Ok(milli));
        }

        #[test]
        fn formatted_gpue_parses_back_for_any_u64(milli in any::<u64>()) {
            prop_assert_eq!(parse_quantity_milli(&format_gpue(milli)), Ok(milli));
        }

        #[test]
        fn plain_quantities_read_as_the_general_parser_reads_them(
            int in prop_oneof![0u64..10_000, any::<u64>()],
            width in 0usize..18,
            suffix in prop_oneof![Just(""), Just("m"), Just("k"), Just("M"), Just("G"), Just("Ki"), Just("Mi"), Just("Gi"), Just("Ti"), Just("u"), Just("e3")],
        ) {
            // Leading zeros included: `width` pads the digits.
            let s = format!("{int:0width$}{suffix}");
            let general = parse_quantity_milli_general(&s);
            if let Some(v) = plain_quantity_milli(&s) {
                prop_assert_eq!(Ok(v), general.clone(), "{}", s);
            }
            prop_assert_eq!(parse_quantity_milli(&s), general);
        }

        #[test]
        fn quantity_parser_never_panics_on_any_string(s in ".*") {
            let _ = parse_quantity_milli(&s);
        }

        #[test]
        fn quantity_parser_never_panics_on_quantity_like_strings(
            s in "[0-9.eEkKmMuinGTPi+-]{0,20}"
        ) {
            let _ = parse_quantity_milli(&s);
        }

        #[test]
        fn duration_parser_never_panics_on_any_string(s in ".*") {
            let _ = parse_duration_ms(&s);
        }

        #[test]
        fn duration_parser_never_panics_on_duration_like_strings(
            s in "[0-9.smhdu+-]{0,24}"
        ) {
            let _ = parse_duration_ms(&s);
        }

        #[test]
        fn formatted_duration_parses_back(ms in 0u64..1_000_000_000_000) {
            prop_assert_eq!(parse_duration_ms(&format_duration_ms(ms)), Ok(ms));
        }

        #[test]
        fn formatted_duration_parses_back_for_any_u64(ms in any::<u64>()) {
            prop_assert_eq!(parse_duration_ms(&format_duration_ms(ms)), Ok(ms));
        }

        #[test]
        fn whole_units_scale_exactly(n in 0u64..1_000_000) {
            prop_assert_eq!(parse_quantity_milli(&n.to_string()), Ok(n * 1000));
            prop_assert_eq!(parse_quantity_milli(&format!("{n}k")), Ok(n * 1_000_000));
            prop_assert_eq!(parse_quantity_milli(&format!("{n}Ki")), Ok(n * 1_024_000));
            prop_assert_eq!(parse_quantity_milli(&format!("{n}u")), Ok(n.div_ceil(1000)));
            prop_assert_eq!(parse_duration_ms(&format!("{n}s")), Ok(n * 1000));
            prop_assert_eq!(parse_duration_ms(&format!("{n}m")), Ok(n * 60_000));
        }
    }
}
