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

/// A `--powerhub-bin` that starts but never says `ready` (not a powerhub binary, or one that
/// hangs) is given up on after `--ready-timeout`, named, and the run fails: it used to wait
/// for ever.
#[test]
fn a_server_that_never_says_ready_is_given_up_on_after_the_ready_timeout() {
    use std::os::unix::fs::PermissionsExt;

    let dir = std::env::temp_dir().join(format!("powerhub-perf-ready-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bin = dir.join("silent-server");
    std::fs::write(&bin, "#!/bin/sh\nexec sleep 600\n").unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_powerhub-perf"))
        .args(["--systems", "powerhub", "--subs", "1", "--sizes", "64"])
        .args([
            "--warmup",
            "0",
            "--measure",
            "0.1",
            "--ready-timeout",
            "0.5",
        ])
        .arg("--powerhub-bin")
        .arg(&bin)
        .arg("--results")
        .arg(&dir)
        .arg("fanout")
        .output()
        .expect("the tool runs");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("--ready-timeout"), "{said}");
    // Given up on, not waited for (the fake would sleep ten minutes).
    assert!(
        started.elapsed() < std::time::Duration::from_secs(300),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);

    let err = refused(&["--ready-timeout=0", "fanout"]);
    assert!(err.contains("--ready-timeout"), "{err}");
}

/// A negative number written after a space is the option's value, refused naming the option
/// (it was taken for an unknown flag, with a tip that would have made it a scenario name).
#[test]
fn a_negative_value_after_a_space_is_refused_naming_its_option() {
    for (option, value) in [
        ("--subs", "-1"),
        ("--sizes", "-5"),
        ("--measure", "-1"),
        ("--warmup", "-1"),
        ("--latency-max", "-3"),
        ("--repeat", "-2"),
    ] {
        let err = refused(&[option, value, "fanout"]);
        assert!(err.contains(option), "{option} {value}: {err}");
        assert!(
            !err.contains("unexpected argument"),
            "{option} {value}: {err}"
        );
    }
}
