//! `kvota usage`: showback over a period.

use anyhow::{bail, Context, Result};
use kvota_client::client::Client;
use kvota_proto::v1;

use super::*;

/// `kvota usage`'s arguments.
#[derive(Debug, clap::Args)]
pub struct UsageArgs {
    /// Start of the period: an RFC 3339 time (`2026-12-01T00:00:00Z`), a date
    /// (`2026-12-01`, midnight UTC), or a duration before now (`24h`, `7d`, `90m`).
    /// Every hour that overlaps the period counts whole.
    #[arg(long, default_value = "24h", value_parser = parse_when)]
    pub since: When,
    /// End of the period (exclusive): the same forms, or `now`.
    #[arg(long, default_value = "now", value_parser = parse_when)]
    pub until: When,
    /// Group rows by `tenant`, `cluster` or `tenant,cluster`; `none` for one total.
    #[arg(long, default_value = "tenant", value_parser = parse_by)]
    pub by: (bool, bool),
    /// Output: `table` for people, `csv` for a spreadsheet, `json` or `yaml` (the HTTP
    /// API's schema).
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: UsageFormat,
}

/// `kvota usage -o`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UsageFormat {
    /// Aligned columns with a total.
    Table,
    /// `tenant,cluster,gpu_hours,since,until` with a header.
    Csv,
    /// One JSON object (the HTTP API's `/api/v1/usage`).
    Json,
    /// The same as YAML.
    Yaml,
}

/// A point in time on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// The federation's now.
    Now,
    /// Milliseconds since the Unix epoch.
    At(u64),
    /// This long before now (the CLI's clock).
    Ago(u64),
}

/// Parses `--since` / `--until` (see [`UsageArgs`]).
pub fn parse_when(s: &str) -> Result<When, String> {
    use time::format_description::well_known::Rfc3339;
    let s = s.trim();
    if s == "now" {
        return Ok(When::Now);
    }
    if s.as_bytes().first().is_some_and(u8::is_ascii_digit) && s.len() >= 10 && s.as_bytes().get(4) == Some(&b'-') {
        let full = if s.len() == 10 {
            format!("{s}T00:00:00Z")
        } else {
            s.to_string()
        };
        let t = time::OffsetDateTime::parse(&full, &Rfc3339)
            .map_err(|e| format!("`{s}` is not an RFC 3339 time or a YYYY-MM-DD date: {e}"))?;
        let ms = t.unix_timestamp_nanos() / 1_000_000;
        return u64::try_from(ms)
            .map(When::At)
            .map_err(|_| format!("`{s}` is before 1970"));
    }
    kvota_fairness::units::parse_duration_ms(s)
        .map(When::Ago)
        .map_err(|e| format!("`{s}` is neither `now`, an RFC 3339 time, a date, nor a duration such as 24h: {e}"))
}

fn parse_by(s: &str) -> Result<(bool, bool), String> {
    if s.trim() == "none" {
        return Ok((false, false));
    }
    let by = kvota_control_plane::http::parse_group_by(s)?;
    if by == (false, false) {
        return Err("name tenant, cluster, both (tenant,cluster) or none".to_string());
    }
    Ok(by)
}

/// A CSV field: quoted when it holds a comma, a quote or a line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// `kvota usage`
pub fn usage(cp: &Cp, a: &UsageArgs) -> Result<()> {
    let wall = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis()),
    )
    .unwrap_or(u64::MAX);
    let ms = |w: When| match w {
        When::Now => 0,
        When::At(t) => t,
        When::Ago(d) => wall.saturating_sub(d),
    };
    let (since_ms, until_ms) = (ms(a.since), ms(a.until));
    if a.since == When::Now {
        bail!("--since now leaves an empty period; give a time or a duration such as 24h");
    }
    if until_ms != 0 && since_ms >= until_ms {
        bail!(
            "--since ({}) must be before --until ({})",
            rfc3339(since_ms),
            rfc3339(until_ms)
        );
    }
    let req = v1::UsageRequest {
        since_ms,
        until_ms,
        by_tenant: a.by.0,
        by_cluster: a.by.1,
    };
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).usage(req).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    let view = kvota_control_plane::view::UsageView::from(&r);
    match a.output {
        UsageFormat::Json => {
            out!("{}", serde_json::to_string_pretty(&view).context("encode the usage")?);
            return Ok(());
        }
        UsageFormat::Yaml => {
            outp!("{}", yaml(&view)?);
            return Ok(());
        }
        UsageFormat::Table | UsageFormat::Csv => {}
    }
    if !view.kept {
        bail!("the control plane keeps no showback yet: it runs below feature level 2 (every node must run a kvota that supports it; see `kvota status`)");
    }
    print_usage(&view, a.output);
    Ok(())
}

/// Prints the usage as a table or as CSV (`*`: all tenants or clusters together).
fn print_usage(view: &kvota_control_plane::view::UsageView, output: UsageFormat) {
    let name = |o: &Option<String>| o.clone().unwrap_or_else(|| "*".to_string());
    match output {
        UsageFormat::Csv => {
            out!("tenant,cluster,gpu_hours,since,until");
            for row in &view.rows {
                out!(
                    "{},{},{:.6},{},{}",
                    csv_field(&name(&row.tenant)),
                    csv_field(&name(&row.cluster)),
                    row.gpu_hours,
                    rfc3339(view.since_ms),
                    rfc3339(view.until_ms)
                );
            }
        }
        _ => {
            out!(
                "GPU-hours from {} to {} (whole hours, undecayed)",
                rfc3339(view.since_ms),
                rfc3339(view.until_ms)
            );
            if let Some(from) = view.kept_from_ms.filter(|f| *f > view.since_ms) {
                out!(
                    "note: hours before {} are no longer kept (the policy's spec.showback.retention)",
                    rfc3339(from)
                );
            }
            out!("{:<24} {:<24} {:>14}", "TENANT", "CLUSTER", "GPU-HOURS");
            for row in &view.rows {
                out!(
                    "{:<24} {:<24} {:>14.3}",
                    name(&row.tenant),
                    name(&row.cluster),
                    row.gpu_hours
                );
            }
            out!("{:<24} {:<24} {:>14.3}", "TOTAL", "", view.total_gpu_hours);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn usage_times_and_groups_parse_strictly() {
        assert_eq!(parse_when("now"), Ok(When::Now));
        assert_eq!(parse_when("24h"), Ok(When::Ago(86_400_000)));
        assert_eq!(parse_when("7d"), Ok(When::Ago(7 * 86_400_000)));
        assert_eq!(parse_when("2026-12-01"), Ok(When::At(1_796_083_200_000)));
        assert_eq!(parse_when("2026-12-01T01:00:00Z"), Ok(When::At(1_796_086_800_000)));
        assert_eq!(parse_when("2026-12-01T02:00:00+01:00"), Ok(When::At(1_796_086_800_000)));
        for bad in [
            "",
            "yesterday",
            "2026-13-01",
            "2026-12-01T25:00:00Z",
            "1969-12-31T00:00:00Z",
            "-5h",
            "24",
        ] {
            assert!(parse_when(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_by("tenant"), Ok((true, false)));
        assert_eq!(parse_by("cluster,tenant"), Ok((true, true)));
        assert_eq!(parse_by("none"), Ok((false, false)));
        assert!(parse_by("team").is_err() && parse_by("").is_err());
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("x\"y"), "\"x\"\"y\"");
        assert_eq!(rfc3339(1_796_086_800_000), "2026-12-01T01:00:00Z");
    }

    proptest! {
        /// Whatever is typed, the parsers answer (a value or a message) and never panic.
        #[test]
        fn usage_arguments_never_panic(s in ".{0,40}", digits in "[0-9]{4}-[0-9]{2}-[0-9]{2}(T[0-9:]{0,10}Z?)?") {
            let _ = parse_when(&s);
            let _ = parse_when(&digits);
            let _ = parse_by(&s);
        }
    }
}
