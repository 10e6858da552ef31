//! Results: a table per scenario with powerhub's ratio against each peer, `.hgrm` percentile
//! files, and SVG plots (latency percentile curves, RSS over time).

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};

use hdrhistogram::Histogram;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

use crate::procfs::RssPoint;

/// One system's figures in one case of a scenario.
#[derive(Debug, Clone, Default)]
pub(crate) struct Row {
    /// The case, e.g. `N=100 64B`.
    pub(crate) case: String,
    /// The system (and variant), e.g. `powerhub drop-oldest`.
    pub(crate) system: String,
    /// Whether this row is powerhub (ratios are taken from it).
    pub(crate) is_powerhub: bool,
    /// Whether this row is a peer powerhub is compared with in ratios.
    pub(crate) is_peer: bool,
    pub(crate) throughput: Option<f64>,
    pub(crate) lost: Option<u64>,
    pub(crate) cpu_per_m: Option<f64>,
    pub(crate) peak_rss_kib: Option<u64>,
    /// p50, p99, p99.9, max in ns.
    pub(crate) latency: Option<[u64; 4]>,
    /// idle-connections: the server's memory per connection, in bytes. Where both rows have
    /// it, it is the ratio taken (the connections open are not a rate).
    pub(crate) mem_per_conn: Option<f64>,
    pub(crate) note: String,
}

impl Row {
    pub(crate) fn latency_of(h: &Histogram<u64>) -> Option<[u64; 4]> {
        (!h.is_empty()).then(|| {
            [
                h.value_at_quantile(0.5),
                h.value_at_quantile(0.99),
                h.value_at_quantile(0.999),
                h.max(),
            ]
        })
    }
}

/// A scenario's results.
#[derive(Debug, Default)]
pub(crate) struct Scenario {
    pub(crate) name: String,
    /// What the throughput column counts (e.g. `deliveries/s`, `MB/s`).
    pub(crate) unit: String,
    pub(crate) rows: Vec<Row>,
    pub(crate) notes: Vec<String>,
    /// Reasons the quick check failed.
    pub(crate) failures: Vec<String>,
    pub(crate) files: Vec<PathBuf>,
}

pub(crate) fn fmt_rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1} k", v / 1e3)
    } else {
        format!("{v:.1}")
    }
}

fn us(ns: u64) -> String {
    let v = ns as f64 / 1e3;
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn opt<T>(v: Option<T>, f: impl Fn(T) -> String) -> String {
    v.map_or_else(|| "–".to_owned(), f)
}

impl Scenario {
    /// The table (markdown) with the ratio lines after it.
    pub(crate) fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "### {}\n", self.name);
        let _ = writeln!(
            s,
            "| case | system | {} | lost | CPU-s/M deliveries | peak RSS MiB | p50 µs | p99 µs | p99.9 µs | max µs | notes |",
            self.unit
        );
        let _ = writeln!(
            s,
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
        );
        for r in &self.rows {
            let l = r.latency;
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.case,
                r.system,
                opt(r.throughput, fmt_rate),
                opt(r.lost, |v| v.to_string()),
                opt(r.cpu_per_m, |v| format!("{v:.3}")),
                opt(r.peak_rss_kib, |v| format!("{:.1}", v as f64 / 1024.0)),
                opt(l, |l| us(l[0])),
                opt(l, |l| us(l[1])),
                opt(l, |l| us(l[2])),
                opt(l, |l| us(l[3])),
                r.note
            );
        }
        let ratios = self.ratios();
        if !ratios.is_empty() {
            let _ = writeln!(s, "\npowerhub against each peer, in what the scenario measures (throughput, or memory per connection; CPU per delivery; p99 and p99.9): > 1 is better for powerhub\n");
            for line in ratios {
                let _ = writeln!(s, "- {line}");
            }
        }
        for n in &self.notes {
            let _ = writeln!(s, "\n{n}");
        }
        s
    }

    fn ratios(&self) -> Vec<String> {
        let mut out = Vec::new();
        for ph in self.rows.iter().filter(|r| r.is_powerhub) {
            for peer in self.rows.iter().filter(|r| r.is_peer && r.case == ph.case) {
                let mut parts = Vec::new();
                if let (Some(a), Some(b)) = (ph.mem_per_conn, peer.mem_per_conn) {
                    if a > 0.0 {
                        parts.push(format!("memory per connection {:.2}×", b / a));
                    }
                } else if let (Some(a), Some(b)) = (ph.throughput, peer.throughput) {
                    if b > 0.0 {
                        parts.push(format!("throughput {:.2}×", a / b));
                    }
                }
                if let (Some(a), Some(b)) = (ph.cpu_per_m, peer.cpu_per_m) {
                    if a > 0.0 {
                        parts.push(format!("CPU {:.2}×", b / a));
                    }
                }
                if let (Some(a), Some(b)) = (ph.latency, peer.latency) {
                    if a[1] > 0 {
                        parts.push(format!("p99 {:.2}×", b[1] as f64 / a[1] as f64));
                        parts.push(format!("p99.9 {:.2}×", b[2] as f64 / a[2].max(1) as f64));
                    }
                }
                if !parts.is_empty() {
                    out.push(format!(
                        "{} — {} vs {}: {}",
                        ph.case,
                        ph.system,
                        peer.system,
                        parts.join(", ")
                    ));
                }
            }
        }
        out
    }
}

/// Write `h` as a `.hgrm` percentile distribution (HdrHistogram's text format, values in µs).
pub(crate) fn write_hgrm(path: &Path, h: &Histogram<u64>) -> io::Result<()> {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:>12} {:>14} {:>10} {:>14}\n",
        "Value", "Percentile", "TotalCount", "1/(1-Percentile)"
    );
    let mut total = 0u64;
    for v in h.iter_quantiles(5) {
        total += v.count_since_last_iteration();
        let q = v.quantile_iterated_to();
        let inv = if q < 1.0 {
            format!("{:>14.2}", 1.0 / (1.0 - q))
        } else {
            format!("{:>14}", "")
        };
        let _ = writeln!(
            s,
            "{:>12.3} {:>2.12} {:>10} {}",
            v.value_iterated_to() as f64 / 1e3,
            q,
            total,
            inv
        );
    }
    let _ = writeln!(
        s,
        "#[Mean    = {:>12.3}, StdDeviation   = {:>12.3}]",
        h.mean() / 1e3,
        h.stdev() / 1e3
    );
    let _ = writeln!(
        s,
        "#[Max     = {:>12.3}, Total count    = {:>12}]",
        h.max() as f64 / 1e3,
        h.len()
    );
    // The sub-bucket count, as HdrHistogram derives it from the significant digits (private in
    // the crate): the smallest power of two covering 2 × 10^sigfig.
    let sub_buckets = (2 * 10u64.pow(u32::from(h.sigfig()))).next_power_of_two();
    let _ = writeln!(
        s,
        "#[Buckets = {:>12}, SubBuckets     = {:>12}]",
        h.buckets(),
        sub_buckets
    );
    std::fs::write(path, s)
}

const COLORS: [RGBColor; 16] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(255, 152, 150),
    RGBColor(174, 199, 232),
    RGBColor(152, 223, 138),
    RGBColor(255, 187, 120),
    RGBColor(197, 176, 213),
    RGBColor(0, 0, 0),
];

fn plot_err<E: std::fmt::Debug>(e: E) -> io::Error {
    io::Error::other(format!("plot: {e:?}"))
}

/// One SVG line chart: a line per series, a legend in the upper left.
fn line_chart<X, Y>(
    path: &Path,
    title: &str,
    (x, y): (X, Y),
    (x_desc, y_desc): (&str, &str),
    x_fmt: &dyn Fn(&f64) -> String,
    lines: Vec<(&str, Vec<(f64, f64)>)>,
) -> io::Result<()>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let root = SVGBackend::new(path, (960, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x, y)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(x_fmt)
        .draw()
        .map_err(plot_err)?;
    for (i, (name, pts)) in lines.into_iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(plot_err)?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)
}

/// Latency percentile curves (x: 1/(1-p) on a log scale, y: µs on a log scale).
pub(crate) fn plot_percentiles(
    path: &Path,
    title: &str,
    series: &[(String, &Histogram<u64>)],
) -> io::Result<()> {
    let series: Vec<_> = series.iter().filter(|(_, h)| !h.is_empty()).collect();
    let (Some(lo), Some(hi)) = (
        series.iter().map(|(_, h)| h.min()).min(),
        series.iter().map(|(_, h)| h.max()).max(),
    ) else {
        return Ok(());
    };
    let (lo, hi) = (lo.max(1) as f64 / 1e3 * 0.8, hi.max(1) as f64 / 1e3 * 1.25);
    let lines = series
        .iter()
        .map(|(name, h)| {
            let pts = h
                .iter_quantiles(5)
                .filter(|v| v.quantile_iterated_to() < 0.99999)
                .map(|v| {
                    (
                        1.0 / (1.0 - v.quantile_iterated_to()),
                        (v.value_iterated_to() as f64 / 1e3).max(lo),
                    )
                })
                .collect();
            (name.as_str(), pts)
        })
        .collect();
    line_chart(
        path,
        title,
        ((1f64..1e5f64).log_scale(), (lo..hi).log_scale()),
        ("percentile", "latency from scheduled send (µs)"),
        &|x| format!("{:.3}%", 100.0 * (1.0 - 1.0 / x)),
        lines,
    )
}

/// Server RSS over time, one line per run.
pub(crate) fn plot_rss(
    path: &Path,
    title: &str,
    series: &[(String, Vec<RssPoint>)],
) -> io::Result<()> {
    let series: Vec<_> = series.iter().filter(|(_, p)| !p.is_empty()).collect();
    let points = || series.iter().flat_map(|(_, p)| p.iter());
    let Some(kib) = points().map(|p| p.1).max() else {
        return Ok(());
    };
    let tmax = points().map(|p| p.0).fold(0.1, f64::max);
    let lines = series
        .iter()
        .map(|(name, pts)| {
            let pts = pts.iter().map(|&(t, k)| (t, k as f64 / 1024.0)).collect();
            (name.as_str(), pts)
        })
        .collect();
    line_chart(
        path,
        title,
        (0f64..tmax, 0f64..(kib as f64 / 1024.0 * 1.1).max(1.0)),
        ("seconds", "server RSS (MiB)"),
        &|x| format!("{x:.1}"),
        lines,
    )
}

/// A file-name-safe form of a label.
pub(crate) fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect::<String>()
        .split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(system: &str, powerhub: bool, throughput: f64, cpu: f64) -> Row {
        Row {
            case: "N=100 64B".to_owned(),
            system: system.to_owned(),
            is_powerhub: powerhub,
            is_peer: !powerhub,
            throughput: Some(throughput),
            cpu_per_m: Some(cpu),
            lost: Some(0),
            ..Row::default()
        }
    }

    #[test]
    fn the_table_gives_powerhubs_ratio_against_each_peer() {
        let sc = Scenario {
            name: "fanout".to_owned(),
            unit: "deliveries/s".to_owned(),
            rows: vec![
                row("powerhub", true, 8e6, 0.05),
                row("redis", false, 4e6, 0.10),
                row("nats", false, 2e6, 0.20),
            ],
            ..Scenario::default()
        };
        let text = sc.render();
        assert!(
            text.contains("| N=100 64B | powerhub | 8.00 M | 0 | 0.050 |"),
            "{text}"
        );
        assert!(
            text.contains("powerhub vs redis: throughput 2.00×, CPU 2.00×"),
            "{text}"
        );
        assert!(
            text.contains("powerhub vs nats: throughput 4.00×, CPU 4.00×"),
            "{text}"
        );
    }

    #[test]
    fn hgrm_lists_percentiles_up_to_the_maximum() {
        let mut h = crate::load::new_histogram();
        for v in 1..=1000u64 {
            h.record(v * 1000).expect("in range");
        }
        let path = std::env::temp_dir().join(format!("powerhub-perf-{}.hgrm", std::process::id()));
        write_hgrm(&path, &h).expect("written");
        let text = std::fs::read_to_string(&path).expect("read back");
        let _ = std::fs::remove_file(&path);
        assert!(text.starts_with("       Value     Percentile TotalCount 1/(1-Percentile)"));
        assert!(
            text.contains("#[Max     =     1000.447, Total count    =         1000]"),
            "{text}"
        );
    }
}
