//! Reports: a markdown table, CSV files and SVG charts from a comparison.

use std::fmt::Write as _;

use crate::engine::RunResult;

/// Human duration: `0 s`, `42 s`, `7.5 min`, `3.2 h`, `2.1 d`.
pub fn human_ms(ms: u64) -> String {
    let s = ms as f64 / 1000.0;
    if s < 90.0 {
        format!("{s:.0} s")
    } else if s < 90.0 * 60.0 {
        format!("{:.1} min", s / 60.0)
    } else if s < 48.0 * 3600.0 {
        format!("{:.1} h", s / 3600.0)
    } else {
        format!("{:.1} d", s / 86400.0)
    }
}

fn pct(x: f64) -> String {
    format!("{:.1} %", x * 100.0)
}

/// The two markdown tables: per scheduler, then per scheduler and tenant.
pub fn markdown(results: &[RunResult]) -> String {
    let mut s = String::new();
    s.push_str("| scheduler | GPU utilization | mean fairness score | unfair time | unfair episodes | recovery p50 | recovery max | preemptions |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in results {
        let _ = writeln!(
            s,
            "| {} | {} | {:.3} | {} | {} | {} | {} | {} |",
            r.scheduler,
            pct(r.utilization),
            r.mean_score,
            pct(r.unfair),
            r.episodes,
            human_ms(r.recovery_p50_ms),
            human_ms(r.recovery_max_ms),
            r.preemptions
        );
    }
    s.push('\n');
    s.push_str("| scheduler | tenant | jobs | delay p50 | delay p99 | never started | share violation | starved | fairness score | inference SLA | latency p99 | preempted | GPU-h lost |\n");
    s.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for r in results {
        for t in &r.tenants {
            if t.jobs == 0 {
                continue;
            }
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {:.3} | {} | {} | {} | {:.0} |",
                r.scheduler,
                t.tenant,
                t.jobs,
                human_ms(t.delay_p50_ms),
                human_ms(t.delay_p99_ms),
                t.never_started,
                pct(t.violation),
                pct(t.starved),
                t.mean_score,
                t.sla.map_or("-".to_string(), pct),
                t.latency_p99.map_or("-".to_string(), |l| format!("{l:.1}x")),
                t.preemptions,
                t.lost_gpu_hours
            );
        }
    }
    s
}

/// One row per scheduler and tenant, every measure.
pub fn results_csv(results: &[RunResult]) -> String {
    let mut s = String::from(
        "scheduler,tenant,jobs,never_started,delay_p50_s,delay_p99_s,share_violation,starved,fairness_score,sla,latency_p99,preemptions,lost_gpu_hours,mean_share,utilization,mean_fairness,unfair,episodes,recovery_p50_s,recovery_max_s\n",
    );
    for r in results {
        for t in &r.tenants {
            let _ = writeln!(
                s,
                "{},{},{},{},{:.3},{:.3},{:.5},{:.5},{:.5},{},{},{},{:.3},{:.5},{:.5},{:.5},{:.5},{},{:.3},{:.3}",
                r.scheduler,
                t.tenant,
                t.jobs,
                t.never_started,
                t.delay_p50_ms as f64 / 1000.0,
                t.delay_p99_ms as f64 / 1000.0,
                t.violation,
                t.starved,
                t.mean_score,
                t.sla.map_or(String::new(), |x| format!("{x:.5}")),
                t.latency_p99.map_or(String::new(), |x| format!("{x:.3}")),
                t.preemptions,
                t.lost_gpu_hours,
                t.mean_share,
                r.utilization,
                r.mean_score,
                r.unfair,
                r.episodes,
                r.recovery_p50_ms as f64 / 1000.0,
                r.recovery_max_ms as f64 / 1000.0
            );
        }
    }
    s
}

/// The time series: scheduler, hours, mean score, then one share column per tenant.
pub fn series_csv(results: &[RunResult]) -> String {
    let mut s = String::from("scheduler,t_hours,fairness_score");
    if let Some(r) = results.first() {
        for t in &r.tenants {
            let _ = write!(s, ",share_{}", t.tenant);
        }
    }
    s.push('\n');
    for r in results {
        for p in &r.series {
            let _ = write!(s, "{},{:.4},{:.5}", r.scheduler, p.t_ms as f64 / 3_600_000.0, p.score);
            for x in &p.shares {
                let _ = write!(s, ",{x:.5}");
            }
            s.push('\n');
        }
    }
    s
}

const PALETTE: [&str; 16] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
];

/// One line of a chart.
#[derive(Debug)]
pub struct Line<'a> {
    /// Legend.
    pub name: &'a str,
    /// Points (x, y).
    pub points: Vec<(f64, f64)>,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The axes' labels and the plot's frame (`(left, top, plot width, plot height, chart
/// height)`).
fn axis_labels(s: &mut String, (l, t, pw, ph, h): (f64, f64, f64, f64, f64), x_label: &str, y_label: &str) {
    let _ = writeln!(
        s,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
        l + pw / 2.0,
        h - 8.0,
        esc(x_label)
    );
    let _ = writeln!(
        s,
        "<text x=\"14\" y=\"{:.1}\" transform=\"rotate(-90 14 {:.1})\" text-anchor=\"middle\">{}</text>",
        t + ph / 2.0,
        t + ph / 2.0,
        esc(y_label)
    );
    let _ = writeln!(
        s,
        "<rect x=\"{l}\" y=\"{t}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#888\"/>"
    );
}

/// A self-contained SVG line chart, y from 0 to `y_max`.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, y_max: f64, lines: &[Line<'_>]) -> String {
    let (w, h, l, r, t, b) = (900.0, 420.0, 60.0, 190.0, 40.0, 50.0);
    let (pw, ph) = (w - l - r, h - t - b);
    let x_max = lines
        .iter()
        .flat_map(|ln| ln.points.iter().map(|p| p.0))
        .fold(0.0_f64, f64::max)
        .max(1e-9);
    let y_max = if y_max > 0.0 { y_max } else { 1.0 };
    let px = |x: f64| l + pw * (x / x_max);
    let py = |y: f64| t + ph * (1.0 - (y / y_max).clamp(0.0, 1.0));
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{l}\" y=\"22\" font-size=\"15\">{}</text>\n",
        esc(title)
    );
    for i in 0..=4 {
        let y = y_max * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            "<line x1=\"{l}\" x2=\"{:.1}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"#ddd\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{y:.2}</text>",
            l + pw,
            py(y),
            py(y),
            l - 6.0,
            py(y) + 4.0
        );
        let x = x_max * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{x:.0}</text>",
            px(x),
            t + ph + 18.0
        );
    }
    axis_labels(&mut s, (l, t, pw, ph, h), x_label, y_label);
    for (i, ln) in lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let pts: Vec<String> = ln
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"1.4\" points=\"{}\"/>",
            pts.join(" ")
        );
        let ly = t + 14.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{ly:.1}\" y2=\"{ly:.1}\" stroke=\"{color}\" stroke-width=\"3\"/><text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            l + pw + 12.0,
            l + pw + 32.0,
            l + pw + 38.0,
            ly + 4.0,
            esc(ln.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Moving average over `k` points each side (charts of noisy series read better).
pub fn smooth(points: &[(f64, f64)], k: usize) -> Vec<(f64, f64)> {
    (0..points.len())
        .map(|i| {
            let lo = i.saturating_sub(k);
            let hi = (i + k + 1).min(points.len());
            let n = (hi - lo) as f64;
            (points[i].0, points[lo..hi].iter().map(|p| p.1).sum::<f64>() / n)
        })
        .collect()
}

/// Hours for spans up to four days, else days: (ms per unit, axis label).
fn time_unit(results: &[RunResult]) -> (f64, &'static str) {
    let last = results
        .iter()
        .filter_map(|r| r.series.last())
        .map(|p| p.t_ms)
        .max()
        .unwrap_or(0);
    if last > 4 * 86_400_000 {
        (86_400_000.0, "trace time (days)")
    } else {
        (3_600_000.0, "trace time (hours)")
    }
}

/// Fairness score over time, one line per scheduler.
pub fn fairness_chart(title: &str, results: &[RunResult]) -> String {
    let (unit, label) = time_unit(results);
    let lines: Vec<Line<'_>> = results
        .iter()
        .map(|r| Line {
            name: &r.scheduler,
            points: smooth(
                &r.series
                    .iter()
                    .map(|p| (p.t_ms as f64 / unit, p.score))
                    .collect::<Vec<_>>(),
                2,
            ),
        })
        .collect();
    line_chart(title, label, "mean fairness score", 1.0, &lines)
}

/// Most tenants a share chart draws one line each for; the rest are summed into one
/// "others" line (150 legend entries in 12 colours cannot be read).
pub const SHARE_CHART_TENANTS: usize = 12;

/// Share of capacity per tenant over time for one scheduler. With more than
/// [`SHARE_CHART_TENANTS`] tenants (with jobs), the largest by mean share get a line
/// each, the others one summed line, and the title says so.
pub fn share_chart(title: &str, r: &RunResult) -> String {
    let (unit, label) = time_unit(std::slice::from_ref(r));
    let mut shown: Vec<usize> = (0..r.tenants.len()).filter(|&i| r.tenants[i].jobs > 0).collect();
    let with_jobs = shown.len();
    let mut rest = Vec::new();
    if with_jobs > SHARE_CHART_TENANTS {
        // Largest first; ties by policy order, so a chart is the same on every run.
        shown.sort_by(|&a, &b| {
            r.tenants[b]
                .mean_share
                .total_cmp(&r.tenants[a].mean_share)
                .then(a.cmp(&b))
        });
        rest = shown.split_off(SHARE_CHART_TENANTS);
        shown.sort_unstable();
    }
    let share_of = |idx: &[usize], p: &crate::engine::Sample| {
        idx.iter()
            .map(|&i| p.shares.get(i).copied().unwrap_or(0.0))
            .sum::<f64>()
    };
    let mut lines: Vec<Line<'_>> = shown
        .iter()
        .map(|&i| Line {
            name: &r.tenants[i].tenant,
            points: r
                .series
                .iter()
                .map(|p| (p.t_ms as f64 / unit, share_of(&[i], p)))
                .collect(),
        })
        .collect();
    let others_name = format!("others ({} tenants)", rest.len());
    let mut title = title.to_string();
    if !rest.is_empty() {
        lines.push(Line {
            name: &others_name,
            points: r
                .series
                .iter()
                .map(|p| (p.t_ms as f64 / unit, share_of(&rest, p)))
                .collect(),
        });
        title = format!("{title} ({SHARE_CHART_TENANTS} largest of {with_jobs} tenants; others summed)");
    }
    line_chart(&title, label, "share of GPUs held", 1.0, &lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_a_person_wrote_them() {
        assert_eq!(human_ms(0), "0 s");
        assert_eq!(human_ms(42_000), "42 s");
        assert_eq!(human_ms(450_000), "7.5 min");
        assert_eq!(human_ms(3 * 3_600_000), "3.0 h");
        assert_eq!(human_ms(3 * 86_400_000), "3.0 d");
    }

    #[test]
    fn charts_are_well_formed_and_escape_names() {
        let svg = line_chart(
            "a <b>",
            "x",
            "y",
            1.0,
            &[Line {
                name: "p&q",
                points: vec![(0.0, 0.5), (2.0, 1.0)],
            }],
        );
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a &lt;b&gt;") && svg.contains("p&amp;q"));
        assert_eq!(svg.matches("<polyline").count(), 1);
    }

    #[test]
    fn share_charts_of_many_tenants_draw_the_largest_and_sum_the_others() {
        use crate::engine::{Sample, TenantResult};
        let n = 150;
        let tenants = (0..n)
            .map(|i| TenantResult {
                tenant: format!("t{i:03}"),
                jobs: 1,
                mean_share: i as f64,
                ..Default::default()
            })
            .collect();
        let series = vec![
            Sample {
                t_ms: 0,
                score: 1.0,
                shares: vec![0.001; n],
            },
            Sample {
                t_ms: 3_600_000,
                score: 1.0,
                shares: vec![0.002; n],
            },
        ];
        let r = RunResult {
            scheduler: "x".into(),
            tenants,
            series,
            ..Default::default()
        };
        let svg = share_chart("x: shares", &r);
        assert_eq!(svg.matches("<polyline").count(), SHARE_CHART_TENANTS + 1);
        assert!(svg.contains("12 largest of 150 tenants; others summed"), "{svg}");
        assert!(svg.contains(">t149<") && svg.contains(">t138<") && !svg.contains(">t137<"));
        assert!(svg.contains("others (138 tenants)"));
        // Few tenants: one line each, no note.
        let mut small = r;
        small.tenants.truncate(3);
        let svg = share_chart("x: shares", &small);
        assert_eq!(svg.matches("<polyline").count(), 3);
        assert!(!svg.contains("others"));
    }
}
