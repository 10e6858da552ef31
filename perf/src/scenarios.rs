//! The PERF.md scenarios, each run against every system with the same load.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use hdrhistogram::Histogram;
use indicatif::ProgressBar;

use crate::clock::now_ns;
use crate::idle;
use crate::inproc;
use crate::load::{rate, run_case, CaseOut, CaseSpec, Pace, ReadMode};
use crate::payload::Template;
use crate::procfs;
use crate::report::{plot_percentiles, plot_rss, slug, write_hgrm, Row, Scenario};
use crate::systems::powerhub::Flavor;
use crate::systems::{Policy, SystemKind, Target};

/// The scenario names, in run order.
pub(crate) const NAMES: [&str; 8] = [
    "fanout",
    "latency",
    "rtt",
    "slow-consumer",
    "screens",
    "idle-connections",
    "scaling",
    "in-process",
];

/// The screens scenario's load.
#[derive(Debug, Clone)]
pub(crate) struct ScreensProfile {
    pub(crate) devices: usize,
    /// hierarchy_update frames per device per second.
    pub(crate) hz: u64,
    /// screenshot_update frames per device per second.
    pub(crate) shot_hz: u64,
    pub(crate) subs: usize,
    pub(crate) stalled: usize,
    pub(crate) secs: f64,
}

/// Everything a scenario needs.
pub(crate) struct Ctx {
    pub(crate) quick: bool,
    pub(crate) results: PathBuf,
    pub(crate) readers: usize,
    pub(crate) warmup: Duration,
    pub(crate) measure: Duration,
    pub(crate) fanout_subs: Vec<usize>,
    pub(crate) sizes: Vec<usize>,
    /// rtt: round trips per block.
    pub(crate) rtt_samples: usize,
    pub(crate) latency_subs: usize,
    pub(crate) latency_fractions: Vec<f64>,
    pub(crate) slow_subs: usize,
    pub(crate) slow_size: usize,
    /// The slow-consumer rate as a fraction of the slowest maximum (`--slow-fraction`).
    pub(crate) slow_fraction: f64,
    /// What the latency fractions are taken of, in messages/s (`--latency-max`): no probes.
    pub(crate) latency_max: Option<f64>,
    /// A fixed slow-consumer rate in messages/s (`--slow-rate`): no probes.
    pub(crate) slow_rate: Option<f64>,
    /// The A/A control (`--slow-control`): "with slow" runs without slow readers.
    pub(crate) slow_control: bool,
    pub(crate) idle_target: usize,
    pub(crate) idle_hold: Duration,
    pub(crate) screens: ScreensProfile,
    pub(crate) inproc_subs: Vec<usize>,
    pub(crate) inproc_deliveries: u64,
    /// The in-process systems to run, by key (`--inproc-systems`); `None`: all.
    pub(crate) inproc_systems: Option<Vec<String>>,
    /// Repetitions of each in-process run (the median is reported).
    pub(crate) reps: usize,
    /// Runs of each socket case (`--repeat`), combined by [`combine_runs`].
    pub(crate) repeat: usize,
    pub(crate) threads: usize,
    pub(crate) targets: Vec<Target>,
    /// Starts extra powerhub servers (one per slow-consumer policy).
    pub(crate) launcher: Option<crate::systems::powerhub::Launcher>,
    pub(crate) pb: ProgressBar,
    pub(crate) max_rates: RefCell<HashMap<(SystemKind, usize, usize), f64>>,
}

/// The bench stream (topic): one letter, so that a 64-byte message fits the routing fields.
pub(crate) const BENCH: &str = "b";

fn window_msgs(size: usize) -> u64 {
    ((1usize << 20) / (size + 48)).clamp(256, 16384) as u64
}

/// Several runs of one case as one: the run with the median throughput, carrying the merged
/// latency histogram of all runs, CPU per delivery pooled over all runs (total CPU over total
/// deliveries), the highest peak RSS, every loss, and every run's throughput (for the note).
pub(crate) fn combine_runs(mut outs: Vec<CaseOut>) -> CaseOut {
    if outs.len() == 1 {
        return outs.pop().expect("one run");
    }
    let runs: Vec<f64> = outs.iter().map(CaseOut::throughput).collect();
    let run_p99: Vec<u64> = outs
        .iter()
        .map(|o| o.fleet.hist.value_at_quantile(0.99))
        .collect();
    let cpu: f64 = outs.iter().map(|o| o.cpu_secs).sum();
    let deliveries: u64 = outs.iter().map(|o| o.deliveries).sum();
    let peak = outs.iter().map(|o| o.peak_rss_kib).max().unwrap_or(0);
    let lost = outs.iter().map(|o| o.lost).sum();
    let short = outs.iter().map(|o| o.short).max().unwrap_or(0);
    let behind = outs
        .iter()
        .map(|o| o.publisher.max_behind)
        .fold(0.0, f64::max);
    let busy: Vec<f64> = outs.iter().filter_map(|o| o.gen_busy).collect();
    let gen_busy = (!busy.is_empty()).then(|| busy.iter().sum::<f64>() / busy.len() as f64);
    let mut order: Vec<usize> = (0..outs.len()).collect();
    order.sort_by(|&a, &b| runs[a].total_cmp(&runs[b]));
    // With an even number of runs, the slower of the middle two: a figure never rounds up.
    let median = order[(order.len() - 1) / 2];
    let mut hist = outs[median].fleet.hist.clone();
    let mut errors = Vec::new();
    for (i, o) in outs.iter().enumerate() {
        if i != median {
            // Same bounds and precision in every run: adding cannot fail.
            let _ = hist.add(&o.fleet.hist);
        }
        errors.extend(o.fleet.errors.iter().cloned());
        if let Some(e) = &o.publisher.error {
            errors.push(format!("publisher: {e}"));
        }
    }
    let mut out = outs.swap_remove(median);
    out.fleet.hist = hist;
    out.fleet.errors = errors;
    out.cpu_secs = cpu * out.deliveries as f64 / deliveries.max(1) as f64;
    out.peak_rss_kib = peak;
    out.lost = lost;
    out.short = short;
    out.publisher.max_behind = behind;
    out.runs = runs;
    out.gen_busy = gen_busy;
    out.run_p99 = run_p99;
    out
}

fn row(case: &str, target: &Target, variant: &str, out: &CaseOut, latency: bool) -> Row {
    let system = if variant.is_empty() {
        target.kind.name().to_owned()
    } else {
        format!("{} {variant}", target.kind.name())
    };
    Row {
        case: case.to_owned(),
        system,
        is_powerhub: target.kind.is_powerhub(),
        is_peer: matches!(
            target.kind,
            SystemKind::Redis | SystemKind::Nats | SystemKind::NatsTls | SystemKind::Raw
        ),
        throughput: Some(out.throughput()),
        lost: Some(out.lost),
        cpu_per_m: (out.deliveries > 0).then(|| out.cpu_per_million()),
        peak_rss_kib: Some(out.peak_rss_kib),
        latency: if latency {
            Row::latency_of(&out.fleet.hist)
        } else {
            None
        },
        mem_per_conn: None,
        note: runs_note(out),
    }
}

fn add_note(rw: &mut Row, note: String) {
    if rw.note.is_empty() {
        rw.note = note;
    } else {
        rw.note = format!("{note}; {}", rw.note);
    }
}

/// "median of K runs: min–max" when a case ran more than once.
fn runs_note(out: &CaseOut) -> String {
    if out.runs.len() < 2 {
        return String::new();
    }
    let lo = out.runs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = out.runs.iter().copied().fold(0.0, f64::max);
    format!(
        "median of {} runs ({}–{}/s)",
        out.runs.len(),
        crate::report::fmt_rate(lo),
        crate::report::fmt_rate(hi)
    )
}

/// Quick-mode check: every normal reader received every message, no reader error.
fn check(sc: &mut Scenario, what: &str, out: &CaseOut) {
    if out.lost > 0 || out.short > 0 {
        let losing: Vec<u64> = out
            .fleet
            .subs
            .iter()
            .filter(|s| s.mode == ReadMode::Normal && s.received < out.publisher.sent)
            .map(|s| out.publisher.sent - s.received)
            .collect();
        sc.failures.push(format!(
            "{}: {what}: {} messages lost by {} subscribers (at most {} by one, {} skipped in sequence), {} short of the last message (sent {})",
            sc.name,
            out.lost,
            losing.len(),
            losing.iter().max().unwrap_or(&0),
            out.fleet.subs.iter().filter(|s| s.mode == ReadMode::Normal).map(|s| s.gaps).sum::<u64>(),
            out.short,
            out.publisher.sent
        ));
    }
    if let Some(e) = &out.publisher.error {
        sc.failures
            .push(format!("{}: {what}: publisher: {e}", sc.name));
    }
    for e in out.fleet.errors.iter().take(3) {
        sc.failures.push(format!("{}: {what}: {e}", sc.name));
    }
}

impl Ctx {
    /// Runs a case `repeat` times (see [`combine_runs`]).
    fn run(&self, target: &Target, label: &str, spec: CaseSpec) -> io::Result<CaseOut> {
        self.run_n(target, label, spec, self.repeat)
    }

    fn run_n(
        &self,
        target: &Target,
        label: &str,
        spec: CaseSpec,
        runs: usize,
    ) -> io::Result<CaseOut> {
        let runs = runs.max(1);
        let outs = (0..runs)
            .map(|i| self.run_one(target, label, &spec, (i, runs)))
            .collect::<io::Result<Vec<_>>>()?;
        self.pb.inc(1);
        Ok(combine_runs(outs))
    }

    /// Run `i` of `runs` of one case, its progress on the bar.
    fn run_one(
        &self,
        target: &Target,
        label: &str,
        spec: &CaseSpec,
        (i, runs): (usize, usize),
    ) -> io::Result<CaseOut> {
        let lbl = if runs > 1 {
            format!("{label} · {} (run {}/{runs})", target.kind, i + 1)
        } else {
            format!("{label} · {}", target.kind)
        };
        self.pb.set_message(lbl.clone());
        let pb = self.pb.clone();
        run_case(target, spec.clone(), &|f| {
            pb.set_message(format!("{lbl} {:>3.0}%", f * 100.0))
        })
    }

    /// Two cases on one target, run alternately `repeat` times (a, b, a, b, …) so that a drift
    /// of the machine between runs weighs on both alike; each side combined as in [`Ctx::run`].
    fn run_pair(
        &self,
        target: &Target,
        (label_a, spec_a): (&str, CaseSpec),
        (label_b, spec_b): (&str, CaseSpec),
    ) -> io::Result<(CaseOut, CaseOut)> {
        let runs = self.repeat.max(1);
        let (mut a, mut b) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
        for i in 0..runs {
            a.push(self.run_one(target, label_a, &spec_a, (i, runs))?);
            b.push(self.run_one(target, label_b, &spec_b, (i, runs))?);
        }
        self.pb.inc(2);
        Ok((combine_runs(a), combine_runs(b)))
    }

    /// One case on every target, run round-robin `repeat` times (run 1 of each target, then
    /// run 2 of each in reverse order, …) so that a drift of the machine during the case weighs on every system
    /// alike, not on whichever ran last; each target's runs combined as in [`Ctx::run`]. A
    /// target whose run fails is not run again.
    fn run_interleaved(
        &self,
        targets: &[Target],
        label: &str,
        spec: &CaseSpec,
    ) -> Vec<io::Result<CaseOut>> {
        let runs = self.repeat.max(1);
        let mut outs: Vec<io::Result<Vec<CaseOut>>> = targets
            .iter()
            .map(|_| Ok(Vec::with_capacity(runs)))
            .collect();
        for i in 0..runs {
            // ABBA: every other round in reverse, so that no system always runs first.
            let mut order: Vec<(&Target, &mut io::Result<Vec<CaseOut>>)> =
                targets.iter().zip(outs.iter_mut()).collect();
            if i % 2 == 1 {
                order.reverse();
            }
            for (t, out) in order {
                if let Ok(done) = out {
                    match self.run_one(t, label, spec, (i, runs)) {
                        Ok(o) => done.push(o),
                        Err(e) => *out = Err(e),
                    }
                }
            }
        }
        self.pb.inc(targets.len() as u64);
        outs.into_iter().map(|o| o.map(combine_runs)).collect()
    }

    fn fanout_spec(&self, n: usize, size: usize, warmup: Duration, measure: Duration) -> CaseSpec {
        CaseSpec {
            topic: BENCH.to_owned(),
            modes: vec![ReadMode::Normal; n],
            templates: vec![Template::new(size, BENCH, "t", "")],
            pace: Pace::Window(window_msgs(size)),
            warmup,
            measure,
            readers: self.readers,
            drain: Duration::from_secs(5),
        }
    }

    /// The system's fanout maximum in messages/s at `n` subscribers (a short probe, cached).
    fn max_rate(&self, target: &Target, n: usize, size: usize) -> io::Result<f64> {
        let key = (target.kind, n, size);
        if let Some(r) = self.max_rates.borrow().get(&key) {
            return Ok(*r);
        }
        let (w, m) = if self.quick { (0.3, 1.0) } else { (0.5, 2.0) };
        let spec = self.fanout_spec(
            n,
            size,
            Duration::from_secs_f64(w),
            Duration::from_secs_f64(m),
        );
        let out = self.run_n(target, &format!("probe N={n} {size}B"), spec, 1)?;
        let r = out.throughput() / n as f64;
        self.max_rates.borrow_mut().insert(key, r);
        Ok(r)
    }

    fn slowest_rate(&self, n: usize, size: usize, sc: &mut Scenario) -> Option<f64> {
        let mut min: Option<f64> = None;
        for t in &self.targets {
            match self.max_rate(t, n, size) {
                Ok(r) => {
                    sc.notes.push(format!(
                        "Fanout maximum of {} at N={n}, {size} B: {:.0} messages/s.",
                        t.kind, r
                    ));
                    min = Some(min.map_or(r, |m: f64| m.min(r)));
                }
                Err(e) => sc
                    .failures
                    .push(format!("{}: probe {}: {e}", sc.name, t.kind)),
            }
        }
        min
    }

    /// The rate a scenario's fractions are taken of: `fixed` (an option naming it, with no
    /// probes) or the slowest system's probed maximum; `None` when no probe succeeded.
    fn base_rate(
        &self,
        fixed: Option<(f64, &str)>,
        n: usize,
        size: usize,
        sc: &mut Scenario,
    ) -> Option<f64> {
        match fixed {
            Some((r, option)) => {
                sc.notes
                    .push(format!("{r:.0} messages/s fixed by {option} (no probes)."));
                Some(r)
            }
            None => self.slowest_rate(n, size, sc),
        }
    }

    /// Progress steps of [`Ctx::base_rate`]'s probes.
    fn probe_steps(&self, fixed: Option<f64>) -> usize {
        if fixed.is_some() {
            0
        } else {
            self.targets.len()
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.results.join(name)
    }
}

/// Run one scenario by name.
pub(crate) fn run(ctx: &Ctx, name: &str) -> io::Result<Scenario> {
    match name {
        "fanout" => fanout(ctx),
        "latency" => latency(ctx),
        "rtt" => crate::rtt::run(ctx),
        "slow-consumer" => slow_consumer(ctx),
        "screens" => screens(ctx),
        "idle-connections" => idle(ctx),
        "scaling" => scaling(ctx),
        "in-process" => inproc::run(ctx),
        other => Err(io::Error::other(format!("unknown scenario {other:?}"))),
    }
}

fn new_scenario(name: &str, unit: &str) -> Scenario {
    Scenario {
        name: name.to_owned(),
        unit: unit.to_owned(),
        ..Scenario::default()
    }
}

/// Fan-out against the shard count: a powerhub server of its own at 1, 2, 4 … shards up to the
/// machine's CPU count, unpinned, N = 1000 (100 with `--quick`) at 64 B. Each row's note gives
/// the speed-up over one shard and each shard thread's CPU seconds over the run (from
/// `/proc/PID/task`), with the spread of their shares: how evenly the fan-out is spread.
fn scaling(ctx: &Ctx) -> io::Result<Scenario> {
    use crate::systems::powerhub::{Flavor, Launcher};
    let mut sc = new_scenario("scaling", "deliveries/s");
    let Some(base) = &ctx.launcher else {
        sc.failures
            .push("scaling: no powerhub binary to start".to_owned());
        return Ok(sc);
    };
    let cpus = crate::procfs::cpus();
    let counts: Vec<usize> = (0..usize::BITS)
        .map(|i| 1usize << i)
        .take_while(|&k| k <= cpus)
        .collect();
    let (n, size) = (if ctx.quick { 100 } else { 1000 }, 64);
    ctx.pb.inc_length(counts.len() as u64);
    let mut one_shard = None;
    for &k in &counts {
        let launcher = Launcher {
            bin: base.bin.clone(),
            shards: k,
            pin: None,
            dir: base.dir.clone(),
            tls: None,
            ready_wait: base.ready_wait,
        };
        let case = format!("N={n} {size}B {k} shards");
        let target = match launcher.start(SystemKind::Powerhub, Flavor::Throughput) {
            Ok(t) => t,
            Err(e) => {
                sc.failures.push(format!("scaling {case}: not run: {e}"));
                continue;
            }
        };
        let before = crate::procfs::thread_cpu_seconds(target.pid, "powerhub-shard")?;
        let out = match ctx.run(
            &target,
            &case,
            ctx.fanout_spec(n, size, ctx.warmup, ctx.measure),
        ) {
            Ok(out) => out,
            Err(e) => {
                sc.failures.push(format!("scaling {case}: {e}"));
                continue;
            }
        };
        let after = crate::procfs::thread_cpu_seconds(target.pid, "powerhub-shard")?;
        check(&mut sc, &case, &out);
        let shard_cpu: Vec<f64> = after
            .iter()
            .map(|&(tid, t)| {
                t - before
                    .iter()
                    .find(|&&(b, _)| b == tid)
                    .map_or(0.0, |&(_, v)| v)
            })
            .collect();
        let total: f64 = shard_cpu.iter().sum();
        let (lo, hi) = shard_cpu
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), &c| {
                (lo.min(c), hi.max(c))
            });
        let speedup = match one_shard {
            None => {
                one_shard = Some(out.throughput());
                1.0
            }
            Some(base) => out.throughput() / base,
        };
        let mut r = row(&case, &target, "", &out, true);
        let spread = if total > 0.0 && lo.is_finite() && lo > 0.0 {
            format!(
                "largest share {:.0} % above the smallest",
                (hi / lo - 1.0) * 100.0
            )
        } else {
            "no shard CPU measured".to_owned()
        };
        let runs = std::mem::take(&mut r.note);
        r.note = format!(
            "{runs}{}{speedup:.2}× one shard; shard CPU s: {}; {spread}",
            if runs.is_empty() { "" } else { "; " },
            shard_cpu
                .iter()
                .map(|c| format!("{c:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        sc.rows.push(r);
    }
    sc.notes.push(format!(
        "A server of its own per row, unpinned, sharing the machine's {cpus} CPUs with the load generator; shard CPU is each shard thread's user + system time over the case (warm-up and runs)."
    ));
    Ok(sc)
}

fn fanout(ctx: &Ctx) -> io::Result<Scenario> {
    let mut sc = new_scenario("fanout", "deliveries/s");
    ctx.pb
        .inc_length((ctx.fanout_subs.len() * ctx.sizes.len() * ctx.targets.len()) as u64);
    let mut rss = Vec::new();
    for &n in &ctx.fanout_subs {
        for &size in &ctx.sizes {
            let case = format!("N={n} {size}B");
            let spec = ctx.fanout_spec(n, size, ctx.warmup, ctx.measure);
            let outs = ctx.run_interleaved(&ctx.targets, &case, &spec);
            for (t, out) in ctx.targets.iter().zip(outs) {
                match out {
                    Ok(out) => {
                        check(&mut sc, &format!("{case} {}", t.kind), &out);
                        rss.push((format!("{} {case}", t.kind), out.rss.clone()));
                        sc.rows.push(row(&case, t, "", &out, true));
                    }
                    Err(e) => sc.failures.push(format!("fanout {case} {}: {e}", t.kind)),
                }
            }
        }
    }
    if ctx.targets.iter().any(|t| t.kind.is_tls()) {
        sc.notes.push(format!(
            "TLS systems: TLS 1.3, the same rustls client (ring) for each; powerhub's records: {}.",
            powerhub::security::tls::RecordLayer::current()
        ));
    }
    sc.notes.push(format!(
        "Closed loop: the publisher writes {} messages per write and stays at most a window of about 1 MiB of messages ahead of the slowest subscriber; latency is from the actual send time.",
        crate::load::PIPELINE
    ));
    let p = ctx.path("fanout-rss.svg");
    plot_rss(&p, "fanout: server RSS over time", &rss)?;
    sc.files.push(p);
    Ok(sc)
}

fn latency(ctx: &Ctx) -> io::Result<Scenario> {
    let mut sc = new_scenario("latency", "deliveries/s");
    let n = ctx.latency_subs;
    let size = 64;
    ctx.pb.inc_length(
        (ctx.probe_steps(ctx.latency_max) + ctx.targets.len() * ctx.latency_fractions.len()) as u64,
    );
    let fixed = ctx.latency_max.map(|r| (r, "--latency-max"));
    let Some(slowest) = ctx.base_rate(fixed, n, size, &mut sc) else {
        return Ok(sc);
    };
    std::fs::create_dir_all(ctx.path("latency"))?;
    for &f in &ctx.latency_fractions {
        let r = slowest * f;
        let case = format!("{:.0}% ({:.0} msg/s × N={n})", f * 100.0, r);
        let mut hists: Vec<(String, Histogram<u64>)> = Vec::new();
        let spec = CaseSpec {
            pace: rate(r),
            ..ctx.fanout_spec(n, size, ctx.warmup, ctx.measure)
        };
        // The systems take turns run by run (ABBA), as in fanout: no system always runs
        // after another.
        let outs = ctx.run_interleaved(&ctx.targets, &case, &spec);
        for (t, out) in ctx.targets.iter().zip(outs) {
            match out {
                Ok(out) => {
                    check(&mut sc, &format!("{case} {}", t.kind), &out);
                    let p = ctx.path(&format!(
                        "latency/{:.0}pct-{}.hgrm",
                        f * 100.0,
                        slug(t.kind.name())
                    ));
                    write_hgrm(&p, &out.fleet.hist)?;
                    sc.files.push(p);
                    let mut rw = row(&case, t, "", &out, true);
                    add_note(
                        &mut rw,
                        format!(
                            "publisher max behind schedule {:.1} ms",
                            out.publisher.max_behind * 1e3
                        ),
                    );
                    if out.run_p99.len() > 1 {
                        let each: Vec<String> = out
                            .run_p99
                            .iter()
                            .map(|&ns| format!("{:.0}", ns as f64 / 1e3))
                            .collect();
                        add_note(&mut rw, format!("p99 of each run {} µs", each.join(" / ")));
                    }
                    add_note(
                        &mut rw,
                        format!(
                            "server used {:.0}% of a CPU",
                            out.cpu_secs / out.secs.max(1e-9) * 100.0
                        ),
                    );
                    if let Some(b) = out.gen_busy {
                        add_note(
                            &mut rw,
                            format!("load generator's CPUs {:.0}% busy", b * 100.0),
                        );
                    }
                    sc.rows.push(rw);
                    hists.push((t.kind.name().to_owned(), out.fleet.hist));
                }
                Err(e) => sc.failures.push(format!("latency {case} {}: {e}", t.kind)),
            }
        }
        let p = ctx.path(&format!("latency-{:.0}pct.svg", f * 100.0));
        let series: Vec<(String, &Histogram<u64>)> =
            hists.iter().map(|(n, h)| (n.clone(), h)).collect();
        plot_percentiles(
            &p,
            &format!(
                "latency at {:.0}% of the slowest maximum, N={n}, 64 B",
                f * 100.0
            ),
            &series,
        )?;
        sc.files.push(p);
    }
    sc.notes.push("Open loop: every message carries its scheduled send time and latency is measured from it, so a stalled publisher or server shows up as latency (no coordinated omission).".to_owned());
    Ok(sc)
}

fn closed(s: &crate::load::SubOutcome) -> String {
    match (s.closed_at, s.closed_unseen) {
        (Some(at), _) => format!(", disconnected at {at:.2} s"),
        (None, true) => ", disconnected (seen after its unread bytes)".to_owned(),
        (None, false) => ", still connected".to_owned(),
    }
}

fn slow_consumer(ctx: &Ctx) -> io::Result<Scenario> {
    let mut sc = new_scenario("slow-consumer", "deliveries/s");
    let n = ctx.slow_subs;
    let size = ctx.slow_size;
    // Per system: the probe, a run without slow readers, then per policy (or once) a run with
    // them, and for each policy server a run without them first.
    let variants: usize = ctx
        .targets
        .iter()
        .map(|t| 1 + t.policies.len().max(1) + t.policies.len())
        .sum();
    ctx.pb
        .inc_length((ctx.probe_steps(ctx.slow_rate) + variants) as u64);
    let fixed = ctx.slow_rate.map(|r| (r, "--slow-rate"));
    let Some(base) = ctx.base_rate(fixed, n, size, &mut sc) else {
        return Ok(sc);
    };
    let (r, rate_note) = if ctx.slow_rate.is_some() {
        (base, "fixed by --slow-rate".to_owned())
    } else {
        (
            base * ctx.slow_fraction,
            format!("{:.0}% of the slowest maximum", ctx.slow_fraction * 100.0),
        )
    };
    let wire_bytes = (size + 48) as f64;
    let slow_bps = (r * wire_bytes * 0.1) as u64;
    // powerhub's subscription queues hold a quarter second of the stream (at least the default
    // 1024): a reader of this load generator that is momentarily behind (its one core reads
    // every subscriber, on a shared machine) is not mistaken for the slow one, while the
    // never-reader still overflows within the run.
    let queue = ((r * 0.25) as usize).max(1024);
    let mut rss = Vec::new();
    // Every p99 of a run without slow readers, per system: they differ only by chance, so
    // their spread is the resolution of the "others' p99" comparison in this run.
    let mut floors: Vec<(SystemKind, Vec<u64>)> = Vec::new();
    for t in &ctx.targets {
        let base_spec = CaseSpec {
            pace: rate(r),
            ..ctx.fanout_spec(n, size, ctx.warmup, ctx.measure)
        };
        let mut base_p99s = Vec::new();
        // A system with policies: a run without slow readers on its default server too (one
        // more floor for the spread below).
        if !t.policies.is_empty() {
            let Some(base) = run_without_slow(ctx, &mut sc, t, "", base_spec.clone(), r) else {
                continue;
            };
            base_p99s.push(others_p99(&base));
            rss.push((format!("{} baseline", t.kind), base.rss.clone()));
        }
        let policies: Vec<Option<Policy>> = if t.policies.is_empty() {
            vec![None]
        } else {
            t.policies.iter().copied().map(Some).collect()
        };
        for policy in policies {
            let mut modes = vec![ReadMode::Normal; n.saturating_sub(2)];
            if ctx.slow_control {
                modes.resize(n, ReadMode::Normal);
            } else {
                modes.push(ReadMode::Slow(slow_bps));
                modes.push(ReadMode::Never);
            }
            let spec = CaseSpec {
                pace: rate(r),
                modes,
                // Longer than NATS's write deadline (10 s): it holds everyone back until it
                // cuts the stalled reader.
                drain: Duration::from_secs(12),
                ..ctx.fanout_spec(n, size, ctx.warmup, ctx.measure)
            };
            let variant = policy.map_or("", |p| p.name());
            // A policy is the server's configuration: a server of its own per policy.
            let dedicated = match (policy, &ctx.launcher) {
                (Some(p), Some(l)) => match l.start(t.kind, Flavor::Policy(p, queue)) {
                    Ok(d) => Some(d),
                    Err(e) => {
                        sc.failures
                            .push(format!("slow-consumer {} {variant}: {e}", t.kind));
                        continue;
                    }
                },
                _ => None,
            };
            let t = dedicated.as_ref().unwrap_or(t);
            // "With slow" is compared with runs without slow readers on the same process,
            // configuration and connection count, run alternately with it.
            let base_label = if variant.is_empty() {
                "slow-consumer baseline".to_owned()
            } else {
                format!("slow-consumer baseline {variant}")
            };
            let (base, out) = match ctx.run_pair(
                t,
                (&base_label, base_spec.clone()),
                (&format!("slow-consumer {variant}"), spec),
            ) {
                Ok(o) => o,
                Err(e) => {
                    sc.failures
                        .push(format!("slow-consumer {} {variant}: {e}", t.kind));
                    continue;
                }
            };
            check(&mut sc, &format!("baseline {} {variant}", t.kind), &base);
            let mut rw = row("without slow", t, variant, &base, true);
            add_note(&mut rw, publisher_note(&base, r));
            sc.rows.push(rw);
            let own_base = others_p99(&base);
            base_p99s.push(own_base);
            if policy.is_none() {
                rss.push((format!("{} baseline", t.kind), base.rss.clone()));
            }
            check(&mut sc, &format!("with slow {} {variant}", t.kind), &out);
            let p99 = others_p99(&out);
            let sent = out.publisher.sent.max(1);
            let fate = |s: &crate::load::SubOutcome| {
                let mut f = format!("got {:.1}%", 100.0 * s.received as f64 / sent as f64);
                if s.gaps > 0 {
                    f += &format!(", {} skipped", s.gaps);
                }
                f += &closed(s);
                f
            };
            let slow = out
                .fleet
                .subs
                .iter()
                .find(|s| matches!(s.mode, ReadMode::Slow(_)));
            let never = out.fleet.subs.iter().find(|s| s.mode == ReadMode::Never);
            let mut rw = row("with slow", t, variant, &out, true);
            let runs = if out.run_p99.len() > 1 {
                let pairs = paired_ratios(&base.run_p99, &out.run_p99);
                format!(
                    " (medians of {} alternating runs: with {} µs, without {} µs; each pair's ratio {}, median {:+.0}%)",
                    out.run_p99.len(),
                    micros(&out.run_p99),
                    micros(&base.run_p99),
                    pairs
                        .iter()
                        .map(|q| format!("{:+.0}%", (q - 1.0) * 100.0))
                        .collect::<Vec<_>>()
                        .join(" "),
                    (median_f64(&pairs) - 1.0) * 100.0
                )
            } else {
                String::new()
            };
            add_note(&mut rw, format!(
                "others' p99 {:+.0}% vs without{runs}; publisher {:.0}/{:.0} msg/s (max {:.1} ms behind); slow reader: {}; never-reader: {}",
                100.0 * (p99 as f64 / own_base.max(1) as f64 - 1.0),
                out.publisher.sent as f64 / out.publisher.secs.max(1e-9),
                r,
                out.publisher.max_behind * 1e3,
                slow.map_or("–".to_owned(), fate),
                never.map_or("–".to_owned(), |s| closed(s).trim_start_matches(", ").to_owned()),
            ));
            sc.rows.push(rw);
            rss.push((
                format!(
                    "{} {}",
                    t.kind,
                    if variant.is_empty() {
                        "with slow"
                    } else {
                        variant
                    }
                ),
                out.rss.clone(),
            ));
        }
        floors.push((t.kind, base_p99s));
    }
    sc.notes.push(format!(
        "N={n}, {size} B, open loop at {r:.0} msg/s ({rate_note}); one subscriber reads at 10% of that rate ({slow_bps} B/s), one never reads. The latency columns are the other subscribers'. powerhub's policy servers queue {queue} messages per subscription (a quarter second of the stream); each policy's \"with slow\" is compared with a run without slow readers on the same server, run just before it. With --repeat the two alternate (without, with, without, …), each side's p99 is the median of its runs' p99, and the note also gives each pair's ratio (with over the without just before it) and their median."
    ));
    if ctx.slow_control {
        sc.notes.push(
            "A/A control (--slow-control): the \"with slow\" runs had no slow readers either; every difference between the two sides is the method's noise at these settings.".to_owned(),
        );
    }
    for (kind, p99s) in &floors {
        if let Some(spread) = spread(p99s) {
            sc.notes.push(format!(
                "{kind}: the {} cases without slow readers had p99 {} µs, a spread of {:.0}%: differences in others' p99 smaller than that are not resolved by this run.",
                p99s.len(),
                micros(p99s),
                spread * 100.0
            ));
        }
    }
    let p = ctx.path("slow-consumer-rss.svg");
    plot_rss(&p, "slow-consumer: server RSS over time", &rss)?;
    sc.files.push(p);
    Ok(sc)
}

/// A slow-consumer run on `t` without slow readers (`variant`: the policy server's, or empty),
/// checked and reported as a "without slow" row; `None`, with the failure noted, when it could
/// not run.
fn run_without_slow(
    ctx: &Ctx,
    sc: &mut Scenario,
    t: &Target,
    variant: &str,
    spec: CaseSpec,
    offered: f64,
) -> Option<CaseOut> {
    let (label, what) = if variant.is_empty() {
        ("slow-consumer baseline".to_owned(), format!("{}", t.kind))
    } else {
        (
            format!("slow-consumer baseline {variant}"),
            format!("{} {variant}", t.kind),
        )
    };
    match ctx.run(t, &label, spec) {
        Ok(out) => {
            check(sc, &format!("baseline {what}"), &out);
            let mut rw = row("without slow", t, variant, &out, true);
            add_note(&mut rw, publisher_note(&out, offered));
            sc.rows.push(rw);
            Some(out)
        }
        Err(e) => {
            sc.failures
                .push(format!("slow-consumer baseline {what}: {e}"));
            None
        }
    }
}

/// The others' p99 of a slow-consumer case: with several runs, the median of the runs' p99
/// (one unlucky run does not decide; with an even number, the higher of the middle two), else
/// the histogram's.
fn others_p99(out: &CaseOut) -> u64 {
    if out.run_p99.len() > 1 {
        let mut v = out.run_p99.clone();
        v.sort_unstable();
        v[v.len() / 2]
    } else {
        out.fleet.hist.value_at_quantile(0.99)
    }
}

/// `with[i] / without[i]` for each pair of runs with a nonzero `without`.
pub(crate) fn paired_ratios(without: &[u64], with: &[u64]) -> Vec<f64> {
    without
        .iter()
        .zip(with)
        .filter(|(w, _)| **w > 0)
        .map(|(w, x)| *x as f64 / *w as f64)
        .collect()
}

/// The median of `v` (the mean of the middle two for an even count; 1.0 when empty: no change).
pub(crate) fn median_f64(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 1.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Nanosecond values as microseconds, slash-separated.
fn micros(ns: &[u64]) -> String {
    ns.iter()
        .map(|v| format!("{:.0}", *v as f64 / 1e3))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// The publisher's achieved rate against the offered one.
fn publisher_note(out: &CaseOut, offered: f64) -> String {
    format!(
        "publisher {:.0}/{offered:.0} msg/s",
        out.publisher.sent as f64 / out.publisher.secs.max(1e-9)
    )
}

/// `max / min - 1` of two or more values (`None` for fewer, or a zero minimum).
fn spread(values: &[u64]) -> Option<f64> {
    let min = *values.iter().min()?;
    let max = *values.iter().max()?;
    (values.len() >= 2 && min > 0).then(|| max as f64 / min as f64 - 1.0)
}

/// The screens scenario's stream (topic).
const SCREENS: &str = "screens";
const SHOT_SIZES: [usize; 3] = [256 << 10, 1 << 20, 2 << 20];
const HIERARCHY_SIZE: usize = 16 << 10;

fn screens(ctx: &Ctx) -> io::Result<Scenario> {
    let prof = &ctx.screens;
    let mut sc = new_scenario("screens", "MB/s delivered");
    ctx.pb.inc_length(ctx.targets.len() as u64);
    // Templates: per device, one hierarchy_update and one screenshot_update per size.
    let per_dev = 1 + SHOT_SIZES.len();
    let mut templates = Vec::new();
    for d in 0..prof.devices {
        let ids = format!(",\"deviceId\":\"device-{d}\",\"deviceSessionUuid\":\"session-{d}\"");
        templates.push(Template::new(
            HIERARCHY_SIZE,
            SCREENS,
            "hierarchy_update",
            &ids,
        ));
        for s in SHOT_SIZES {
            templates.push(Template::new(s, SCREENS, "screenshot_update", &ids));
        }
    }
    // The schedule: ticks at `hz`, devices spread across the tick; screenshots every few ticks.
    let tick = 1e9 / prof.hz as f64;
    let every = (prof.hz / prof.shot_hz.max(1)).max(1);
    let ticks = (prof.secs * prof.hz as f64) as u64;
    let mut sched: Vec<(u64, usize)> = Vec::new();
    let mut offered_bytes = 0usize;
    for k in 0..ticks {
        for d in 0..prof.devices {
            let off = (k as f64 * tick + d as f64 * tick / prof.devices as f64) as u64;
            sched.push((off, d * per_dev));
            offered_bytes += HIERARCHY_SIZE;
            if k % every == 0 {
                let s = ((k / every) as usize + d) % SHOT_SIZES.len();
                sched.push((off, d * per_dev + 1 + s));
                offered_bytes += SHOT_SIZES[s];
            }
        }
    }
    let sched = std::sync::Arc::new(sched);
    let healthy = prof.subs - prof.stalled;
    let mut rss = Vec::new();
    for t in &ctx.targets {
        let mut modes = vec![ReadMode::Normal; healthy];
        modes.extend(std::iter::repeat_n(ReadMode::Never, prof.stalled));
        let s2 = sched.clone();
        let spec = CaseSpec {
            topic: SCREENS.to_owned(),
            modes,
            templates: templates.clone(),
            pace: Pace::Schedule(std::sync::Arc::new(move |seq| {
                s2.get(seq as usize).copied()
            })),
            warmup: Duration::ZERO,
            measure: Duration::from_secs_f64(prof.secs),
            readers: ctx.readers,
            // Longer than NATS's write deadline (10 s), after which it cuts a stalled reader
            // and the others catch up.
            drain: Duration::from_secs(12),
        };
        let out = match ctx.run(t, "screens", spec) {
            Ok(o) => o,
            Err(e) => {
                sc.failures.push(format!("screens {}: {e}", t.kind));
                continue;
            }
        };
        if out.short > 0 || out.publisher.error.is_some() || !out.fleet.errors.is_empty() {
            sc.failures.push(format!(
                "screens {}: {} healthy subscribers did not get the last frame; publisher: {:?}; readers: {:?}",
                t.kind,
                out.short,
                out.publisher.error,
                out.fleet.errors.iter().take(2).collect::<Vec<_>>()
            ));
        }
        let h: Vec<_> = out
            .fleet
            .subs
            .iter()
            .filter(|s| s.mode == ReadMode::Normal)
            .collect();
        let bytes: u64 = h.iter().map(|s| s.bytes).sum();
        let notices: u64 = out.fleet.subs.iter().map(|s| s.frames_dropped).sum();
        let stalled_closed = out
            .fleet
            .subs
            .iter()
            .filter(|s| s.mode == ReadMode::Never && s.closed_at.is_some())
            .count();
        let mut rw = row("screens", t, "", &out, true);
        // Everything the healthy subscribers read, over the time until they had read it.
        rw.throughput = Some(bytes as f64 / 1e6 / out.until_drained.max(1e-9));
        rw.cpu_per_m = None;
        add_note(&mut rw, format!(
            "offered {:.0} MB/s per subscriber, published {}/{} frames in {:.1} s, drained after {:.1} s; healthy: {} frames not delivered (coalesced or dropped), {} frames_dropped notices; stalled subscribers disconnected: {stalled_closed}/{}",
            offered_bytes as f64 / 1e6 / prof.secs,
            out.publisher.sent,
            sched.len(),
            out.publisher.secs,
            out.until_drained,
            out.lost,
            notices,
            prof.stalled,
        ));
        sc.rows.push(rw);
        rss.push((t.kind.name().to_owned(), out.rss.clone()));
    }
    sc.notes.push(format!(
        "{} devices, hierarchy_update ({} KiB) at {} Hz and screenshot_update (256 KiB–2 MiB) at {} Hz each, {} subscribers of which {} never read; {:.1} s. Throughput is bytes delivered to the healthy subscribers; latency is theirs.",
        prof.devices, HIERARCHY_SIZE >> 10, prof.hz, prof.hz / (prof.hz / prof.shot_hz.max(1)).max(1), prof.subs, prof.stalled, prof.secs
    ));
    let p = ctx.path("screens-rss.svg");
    plot_rss(&p, "screens: server RSS over time", &rss)?;
    sc.files.push(p);
    Ok(sc)
}

fn idle(ctx: &Ctx) -> io::Result<Scenario> {
    let mut sc = new_scenario("idle-connections", "connections");
    ctx.pb.inc_length(ctx.targets.len() as u64);
    // Every connection is a descriptor of the server's process, except where powerhub keeps it
    // as an io_uring direct descriptor: the per-process limit caps the other servers (the
    // client spreads its side over helper processes, see `idle`).
    let cap = procfs::nofile_hard().saturating_sub(1024) as usize;
    let mut rss = Vec::new();
    for (sys, t) in ctx.targets.iter().enumerate() {
        if t.kind.is_tls() {
            sc.failures.push(format!(
                "idle-connections {}: not run (the idle holders connect in plaintext)",
                t.kind
            ));
            ctx.pb.inc(1);
            continue;
        }
        // powerhub: a server of its own with a one-second keepalive, so that pings and pongs
        // run on every connection during the hold.
        // Sized for the connections it will be given: all of them on io_uring (direct
        // descriptors), at most the descriptor limit less 1 024 on epoll.
        let asked = if t.kind == SystemKind::PowerhubEpoll {
            ctx.idle_target.min(cap)
        } else {
            ctx.idle_target
        };
        let dedicated = match (t.kind.is_powerhub(), &ctx.launcher) {
            (true, Some(l)) => Some(l.start(t.kind, Flavor::Idle(asked))?),
            _ => None,
        };
        let t = dedicated.as_ref().unwrap_or(t);
        let direct = dedicated
            .as_ref()
            .is_some_and(|d| d.kind == SystemKind::Powerhub && d.backend == "io_uring");
        let k = if direct {
            ctx.idle_target
        } else {
            ctx.idle_target.min(cap)
        };
        if k < ctx.idle_target {
            sc.notes.push(format!(
                "{}: asked for {} connections; this machine's hard limit of {} open files per process (not raisable here) caps its server, so {k} were opened.",
                t.kind,
                ctx.idle_target,
                procfs::nofile_hard()
            ));
        }
        ctx.pb
            .set_message(format!("idle-connections · {} {k} connections", t.kind));
        let sampler = procfs::RssSampler::start(t.pid, Duration::from_millis(100));
        let base = procfs::rss_kib(t.pid)?;
        let t0 = now_ns();
        let (holders, opened, err) = idle::Holders::open(t, sys, k)?;
        let open_secs = (now_ns() - t0) as f64 / 1e9;
        // Hold: the holders read what arrives every 200 ms and answer keepalives, at least two
        // keepalive intervals of a powerhub server of its own.
        let hold = if dedicated.is_some() {
            ctx.idle_hold
                .max(2 * crate::systems::powerhub::idle_keepalive(asked))
        } else {
            ctx.idle_hold
        };
        let cpu_before = procfs::cpu_seconds(t.pid)?;
        std::thread::sleep(hold);
        let hold_cpu = (procfs::cpu_seconds(t.pid)? - cpu_before) / hold.as_secs_f64();
        let after = procfs::rss_kib(t.pid)?;
        let held = holders.stop()?;
        let alive = held.alive;
        let per = (after as f64 - base as f64) * 1024.0 / opened.max(1) as f64;
        let series = sampler.finish();
        let peak = series.iter().map(|p| p.1).max().unwrap_or(after);
        rss.push((t.kind.name().to_owned(), series));
        if alive < k {
            sc.failures.push(format!(
                "idle-connections {}: {alive}/{k} connections alive{}",
                t.kind,
                err.as_deref().map_or(String::new(), |e| format!(" ({e})"))
            ));
        }
        sc.rows.push(Row {
            case: format!("{} idle subscribers", ctx.idle_target),
            system: t.kind.name().to_owned(),
            is_powerhub: t.kind.is_powerhub(),
            is_peer: matches!(t.kind, SystemKind::Redis | SystemKind::Nats),
            throughput: Some(alive as f64),
            peak_rss_kib: Some(peak),
            mem_per_conn: Some(per),
            note: format!(
                "{:.2} KiB of server RSS per connection ({:.1} → {:.1} MiB{}); opened in {open_secs:.1} s, held {:.0} s at {:.0} % of a CPU, {} keepalive pings answered{}",
                per / 1024.0,
                base as f64 / 1024.0,
                after as f64 / 1024.0,
                if after < base { ": RSS fell, memory freed by the runtime meanwhile" } else { "" },
                hold.as_secs_f64(),
                hold_cpu * 100.0,
                held.pongs,
                err.map_or(String::new(), |e| format!("; stopped: {e}"))
            ),
            ..Row::default()
        });
        ctx.pb.inc(1);
        // Let the server release the connections before the next system.
        std::thread::sleep(Duration::from_millis(300));
    }
    sc.notes.push("powerhub runs with a one-second keepalive here (fewer pings past 25 000 connections: at most 25 000 a second in all, held for at least two intervals; a server of its own with at least two shards, and enough that each holds its connections as io_uring direct descriptors under the descriptor limit, pinned to the one server CPU like the others), so pings and pongs flow on every connection during the hold; NATS pings every two minutes and Redis not at all. The throughput column is the number of connections still open after the hold. Memory per connection is the server's RSS growth divided by the connections (kernel socket memory is not in RSS). The client's connections are held by helper processes of at most one descriptor limit each.".to_owned());
    let p = ctx.path("idle-connections-rss.svg");
    plot_rss(&p, "idle-connections: server RSS over time", &rss)?;
    sc.files.push(p);
    Ok(sc)
}

#[cfg(test)]
mod tests {
    use super::{combine_runs, median_f64, paired_ratios, spread};
    use crate::load::{new_histogram, CaseOut, FleetOut, PubOut};

    fn run(deliveries: u64, latencies_us: &[u64], busy: Option<f64>) -> CaseOut {
        let mut hist = new_histogram();
        for &us in latencies_us {
            hist.record(us * 1_000).expect("in range");
        }
        CaseOut {
            deliveries,
            secs: 1.0,
            cpu_secs: 0.5,
            peak_rss_kib: deliveries,
            rss: Vec::new(),
            publisher: PubOut::default(),
            fleet: FleetOut {
                hist,
                subs: Vec::new(),
                errors: Vec::new(),
            },
            lost: 0,
            short: 0,
            until_drained: 1.0,
            runs: Vec::new(),
            run_p99: Vec::new(),
            gen_busy: busy,
        }
    }

    #[test]
    fn combined_runs_keep_the_median_run_and_each_runs_p99() {
        let out = combine_runs(vec![
            run(300, &[100; 100], Some(0.5)),
            run(100, &[300; 100], Some(1.0)),
            run(200, &[200; 100], None),
        ]);
        assert_eq!(out.deliveries, 200, "the median run's throughput");
        assert_eq!(out.runs, vec![300.0, 100.0, 200.0]);
        let p99_us: Vec<u64> = out.run_p99.iter().map(|ns| ns / 1_000).collect();
        assert_eq!(
            p99_us,
            vec![100, 300, 200],
            "each run's own p99, in run order"
        );
        assert_eq!(
            out.fleet.hist.len(),
            300,
            "latencies of every run are pooled"
        );
        assert_eq!(out.peak_rss_kib, 300, "the highest peak");
        assert_eq!(
            out.gen_busy,
            Some(0.75),
            "the mean over the runs that measured it"
        );
        assert!(
            (out.cpu_per_million() - 2_500.0).abs() < 1e-6,
            "CPU pooled over all runs"
        );
    }

    #[test]
    fn spread_is_the_largest_over_the_smallest_minus_one() {
        assert_eq!(spread(&[2_000, 3_000, 2_500]), Some(0.5));
        assert_eq!(spread(&[4_000, 4_000]), Some(0.0));
    }

    #[test]
    fn paired_ratios_divide_each_with_by_the_without_just_before_it() {
        let q = paired_ratios(&[1_000, 2_000, 0, 4_000], &[1_100, 1_000, 500, 4_000]);
        assert_eq!(q, vec![1.1, 0.5, 1.0]);
        assert_eq!(median_f64(&q), 1.0);
        assert_eq!(median_f64(&[1.5, 0.75]), 1.125);
        assert_eq!(median_f64(&[]), 1.0);
    }

    #[test]
    fn spread_needs_two_runs_and_a_nonzero_minimum() {
        assert_eq!(spread(&[]), None);
        assert_eq!(spread(&[3_000]), None);
        assert_eq!(spread(&[0, 3_000]), None);
    }
}
