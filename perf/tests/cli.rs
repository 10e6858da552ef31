//! The tool refuses bad options with an error naming the option, before it runs anything.

use std::process::Command;

fn refused(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_powerhub-perf"))
        .args(args)
        .arg("--results")
        .arg(std::env::temp_dir().join("powerhub-perf-cli-test"))
        .output()
        .expect("the tool runs");
    assert!(!out.status.success(), "{args:?} was accepted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_rate_that_is_not_a_rate_is_refused_naming_its_option() {
    for (option, value) in [
        ("--slow-rate", "0"),
        ("--slow-rate", "NaN"),
        ("--latency-max", "-5"),
        ("--latency-max", "inf"),
    ] {
        let err = refused(&[&format!("{option}={value}"), "latency"]);
        assert!(err.contains(option) && err.contains("not a rate"), "{err}");
    }
}

#[test]
fn a_slow_fraction_outside_zero_to_one_is_refused() {
    let err = refused(&["--slow-fraction", "1.5", "slow-consumer"]);
    assert!(
        err.contains("--slow-fraction 1.5 is not in (0, 1]"),
        "{err}"
    );
}

#[test]
fn an_unknown_in_process_system_is_refused_naming_the_option_and_the_systems() {
    let err = refused(&["--inproc-systems", "receivers,nope", "in-process"]);
    assert!(
        err.contains("\"nope\" in --inproc-systems") && err.contains("receivers-borrowed"),
        "{err}"
    );
}

#[test]
fn values_no_run_can_use_are_refused_naming_their_option() {
    for (args, says) in [
        (&["--subs", "0", "fanout"][..], "--subs"),
        (&["--inproc-subs", "1,0", "in-process"], "--inproc-subs"),
        (&["--devices", "0", "screens"], "--devices"),
        (&["--shot-hz", "0", "screens"], "--shot-hz"),
        (&["--idle", "0", "idle-connections"], "--idle"),
        (&["--measure", "0", "fanout"], "--measure"),
        (&["--warmup=-1", "fanout"], "--warmup"),
        (&["--rates", "0", "latency"], "--rates"),
        (&["--sizes", "0", "fanout"], "--sizes"),
        (&["--systems", "raw,raw", "fanout"], "raw"),
        (&["fanout", "fanout"], "fanout"),
    ] {
        let err = refused(args);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn a_results_directory_that_cannot_be_made_is_named() {
    let file = std::env::temp_dir().join(format!("powerhub-perf-cli-{}", std::process::id()));
    std::fs::write(&file, b"").unwrap();
    let path = file.to_str().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_powerhub-perf"))
        .args(["--results", path, "--systems", "raw", "fanout"])
        .output()
        .expect("the tool runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(path) && err.contains("--results"), "{err}");
    let _ = std::fs::remove_file(&file);
}
