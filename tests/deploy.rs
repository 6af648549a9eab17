//! The service files in `deploy/` as an operator installs them: the systemd
//! unit passes `systemd-analyze verify` (or, where that tool is absent, an
//! INI reading of its own), the launchd plist parses, and the command line
//! each of them runs, pointed at temporary copies of its config, passes
//! `inferd serve --check` through the real binary. Broken configs must fail
//! with a message that names the problem. The shard and relay services of a
//! split model: their units verify and score like the server's, and a
//! split model runs from the shipped environment files and config.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

const UNIT: &str = "deploy/systemd/inferd.service";
const UNIT_CONFIG: &str = "deploy/systemd/inferd.toml";
const PLIST: &str = "deploy/launchd/dev.inferd.plist";
const PLIST_CONFIG: &str = "deploy/launchd/inferd.toml";
const SHARD_UNIT: &str = "deploy/systemd/inferd-shard.service";
const SHARD_ENV: &str = "deploy/systemd/inferd-shard.env";
const RELAY_UNIT: &str = "deploy/systemd/inferd-relay.service";
const RELAY_ENV: &str = "deploy/systemd/inferd-relay.env";
const SHARD_PLIST: &str = "deploy/launchd/dev.inferd.shard.plist";
const RELAY_PLIST: &str = "deploy/launchd/dev.inferd.relay.plist";

/// Where deploy/README.md tells the operator to put each file.
const INSTALLED_BINARY: &str = "/usr/local/bin/inferd";
const INSTALLED_UNIT_CONFIG: &str = "/etc/inferd/inferd.toml";
const INSTALLED_PLIST_CONFIG: &str = "/usr/local/etc/inferd/inferd.toml";

/// The drain timeout `inferd serve` uses when the config sets none.
const DEFAULT_DRAIN_SECS: u64 = 30;

fn have_model() -> bool {
    let ok = Path::new(REFERENCE).exists();
    if !ok {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
    }
    ok
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// One `Key=Value` assignment of a unit file, with the section it is in.
#[derive(Debug)]
struct UnitEntry {
    section: String,
    key: String,
    value: String,
}

/// Reads a systemd unit the way systemd does for these files: `[Section]`
/// headers, `Key=Value` lines, `#`/`;` comments, a trailing backslash
/// continuing a line. Anything else is a syntax error.
fn parse_unit(text: &str) -> Vec<UnitEntry> {
    let mut entries = Vec::new();
    let mut section: Option<String> = None;
    let mut pending = String::new();
    for (number, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if pending.is_empty() && (line.is_empty() || line.starts_with('#') || line.starts_with(';'))
        {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        let whole = std::mem::take(&mut pending) + line;
        if let Some(name) = whole.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = Some(name.to_owned());
            continue;
        }
        let (key, value) = whole
            .split_once('=')
            .unwrap_or_else(|| panic!("{UNIT}:{}: not Key=Value: {raw:?}", number + 1));
        let section = section
            .clone()
            .unwrap_or_else(|| panic!("{UNIT}:{}: assignment before any section", number + 1));
        entries.push(UnitEntry {
            section,
            key: key.trim().to_owned(),
            value: value.trim().to_owned(),
        });
    }
    assert!(pending.is_empty(), "{UNIT}: ends inside a continued line");
    entries
}

/// The value of the last assignment of `key` in `section` (later ones win).
fn unit_value<'a>(entries: &'a [UnitEntry], section: &str, key: &str) -> Option<&'a str> {
    entries
        .iter()
        .rev()
        .find(|e| e.section == section && e.key == key)
        .map(|e| e.value.as_str())
}

fn service_value<'a>(entries: &'a [UnitEntry], key: &str) -> &'a str {
    unit_value(entries, "Service", key).unwrap_or_else(|| panic!("{UNIT}: no {key}= in [Service]"))
}

/// Seconds of a systemd time span such as `45`, `45s`, `2min` or `1min 30s`.
fn unit_seconds(span: &str) -> u64 {
    span.split_whitespace()
        .map(|part| {
            let digits_end = part
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(part.len());
            let (number, unit) = part.split_at(digits_end);
            let number: u64 = number
                .parse()
                .unwrap_or_else(|_| panic!("time span {span:?}"));
            match unit {
                "" | "s" | "sec" => number,
                "min" | "m" => number * 60,
                other => panic!("time span {span:?}: unit {other:?} not expected here"),
            }
        })
        .sum()
}

/// The unquoted words of an `ExecStart=` line (this unit uses no quoting,
/// specifiers or prefixes; the test refuses them rather than guess).
fn exec_start_words(entries: &[UnitEntry]) -> Vec<String> {
    let line = service_value(entries, "ExecStart");
    assert!(
        !line.contains(['"', '\'', '%', '$']) && !line.starts_with(['-', '@', '+', '!', ':']),
        "ExecStart uses quoting, specifiers or prefixes this test does not read: {line}"
    );
    line.split_whitespace().map(str::to_owned).collect()
}

/// `key = value` lines of a config, commented-out ones included, as
/// (key, value, commented).
fn config_keys(text: &str) -> Vec<(String, String, bool)> {
    text.lines()
        .filter_map(|line| {
            let (commented, body) = match line.strip_prefix('#') {
                Some(rest) => (true, rest),
                None => (false, line),
            };
            let (key, value) = body.split_once(" = ")?;
            let plain = !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            plain.then(|| (key.to_owned(), value.trim().to_owned(), commented))
        })
        .collect()
}

fn config_value(text: &str, key: &str) -> Option<String> {
    config_keys(text)
        .into_iter()
        .find(|(k, _, commented)| k == key && !commented)
        .map(|(_, v, _)| v)
}

fn drain_secs(config: &str) -> u64 {
    config_value(config, "drain_timeout").map_or(DEFAULT_DRAIN_SECS, |v| {
        v.parse().unwrap_or_else(|_| panic!("drain_timeout = {v}"))
    })
}

fn reference_model() -> PathBuf {
    std::fs::canonicalize(REFERENCE).unwrap_or_else(|e| panic!("{REFERENCE}: {e}"))
}

/// The shipped config with its model line pointed at the reference model
/// (and any other edits), written into `dir`.
fn config_copy(dir: &Path, shipped: &str, edit: impl Fn(String) -> String) -> PathBuf {
    let model = reference_model();
    let mut replaced = false;
    let text: String = read(shipped)
        .lines()
        .map(|line| {
            if line.starts_with("model = ") {
                replaced = true;
                format!("model = {:?}\n", model.display().to_string())
            } else if line.starts_with("state_dir = ") {
                // Sessions of a test stay in its own folder.
                format!(
                    "state_dir = {:?}\n",
                    dir.join("state").display().to_string()
                )
            } else {
                format!("{line}\n")
            }
        })
        .collect();
    assert!(replaced, "{shipped} sets no model");
    let path = dir.join("inferd.toml");
    std::fs::write(&path, edit(text)).expect("write config copy");
    path
}

/// Runs the real binary with `args`, untouched by any INFERD_* variable of
/// the environment the tests happen to run in.
fn run_inferd(args: &[String]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_inferd"));
    cmd.args(args);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("INFERD_") {
            cmd.env_remove(key);
        }
    }
    cmd.output().expect("run inferd")
}

/// The service's command line with the installed binary dropped, the
/// installed config path replaced by `config`, and `--check` added.
fn check_args(words: &[String], installed_config: &str, config: &Path) -> Vec<String> {
    assert_eq!(
        words.first().map(String::as_str),
        Some(INSTALLED_BINARY),
        "the service runs another binary than the one deploy/README.md installs"
    );
    let config_at = words
        .iter()
        .position(|w| w == "--config")
        .unwrap_or_else(|| panic!("no --config in {words:?}"));
    assert_eq!(
        words.get(config_at + 1).map(String::as_str),
        Some(installed_config),
        "the service reads its config from another path than deploy/README.md says"
    );
    let mut args: Vec<String> = words[1..].to_vec();
    args[config_at] = config.display().to_string();
    args.push("--check".to_owned());
    args
}

fn plist_dict() -> plist::Dictionary {
    plist_dict_of(PLIST)
}

fn plist_dict_of(path: &str) -> plist::Dictionary {
    plist::Value::from_file(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .into_dictionary()
        .unwrap_or_else(|| panic!("{path}: the top level is not a dict"))
}

fn plist_program_arguments(dict: &plist::Dictionary) -> Vec<String> {
    dict.get("ProgramArguments")
        .and_then(plist::Value::as_array)
        .unwrap_or_else(|| panic!("{PLIST}: no ProgramArguments array"))
        .iter()
        .map(|v| {
            v.as_string()
                .unwrap_or_else(|| panic!("{PLIST}: a non-string argument {v:?}"))
                .to_owned()
        })
        .collect()
}

#[test]
fn systemd_unit_declares_a_sandboxed_notify_service() {
    let unit = parse_unit(&read(UNIT));
    let sections: BTreeSet<&str> = unit.iter().map(|e| e.section.as_str()).collect();
    assert_eq!(
        sections,
        BTreeSet::from(["Unit", "Service", "Install"]),
        "sections of {UNIT}"
    );
    let expect = |key: &str, want: &str| {
        assert_eq!(service_value(&unit, key), want, "{UNIT}: {key}=");
    };
    expect("Type", "notify");
    expect("Restart", "on-failure");
    expect("DynamicUser", "yes");
    expect("StateDirectory", "inferd");
    expect("NoNewPrivileges", "yes");
    expect("CapabilityBoundingSet", "");
    expect("ProtectSystem", "strict");
    expect("ProtectHome", "yes");
    expect("PrivateTmp", "yes");
    expect("PrivateDevices", "yes");
    expect("MemoryDenyWriteExecute", "yes");
    expect("LockPersonality", "yes");
    expect("RestrictNamespaces", "yes");
    for key in [
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
    ] {
        expect(key, "yes");
    }
    let families: BTreeSet<&str> = service_value(&unit, "RestrictAddressFamilies")
        .split_whitespace()
        .collect();
    assert_eq!(families, BTreeSet::from(["AF_INET", "AF_INET6", "AF_UNIX"]));
    assert!(
        unit.iter()
            .any(|e| e.key == "SystemCallFilter" && e.value == "@system-service"),
        "{UNIT}: no SystemCallFilter=@system-service"
    );
    assert!(unit_seconds(service_value(&unit, "RestartSec")) >= 1);
    assert!(
        service_value(&unit, "LimitNOFILE")
            .parse::<u64>()
            .expect("LimitNOFILE")
            >= 4096
    );
    assert_eq!(
        unit_value(&unit, "Install", "WantedBy"),
        Some("multi-user.target")
    );

    let config = read(UNIT_CONFIG);
    let stop = unit_seconds(service_value(&unit, "TimeoutStopSec"));
    let drain = drain_secs(&config);
    assert!(
        stop > drain,
        "TimeoutStopSec={stop}s must exceed drain_timeout = {drain} so that a drain is never killed"
    );
    let model = config_value(&config, "model").expect("model in the unit's config");
    assert!(
        model.starts_with("\"/var/lib/inferd/models/"),
        "the unit's model {model} is not under its StateDirectory"
    );
}

#[test]
fn systemd_analyze_verifies_the_unit() {
    let probe = Command::new("systemd-analyze").arg("--version").output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!(
            "SKIPPED (LOUDLY): systemd-analyze is not installed here, so {UNIT} was only \
             read as INI by systemd_unit_declares_a_sandboxed_notify_service, not verified \
             by systemd itself"
        );
        return;
    }
    for unit in [UNIT, SHARD_UNIT, RELAY_UNIT] {
        if !analyze(unit) {
            return;
        }
    }
}

/// `systemd-analyze verify` and `security` of one unit; false when this
/// systemd cannot score a unit offline (said loudly).
fn analyze(unit: &str) -> bool {
    // `verify` insists the ExecStart binary exists and is executable: point
    // a copy of the unit at the binary under test.
    let dir = tempfile::tempdir().expect("tempdir");
    let text = read(unit);
    assert!(text.contains(&format!("ExecStart={INSTALLED_BINARY} ")));
    let copy = dir
        .path()
        .join(Path::new(unit).file_name().expect("unit file name"));
    std::fs::write(
        &copy,
        text.replace(
            &format!("ExecStart={INSTALLED_BINARY} "),
            &format!("ExecStart={} ", env!("CARGO_BIN_EXE_inferd")),
        ),
    )
    .expect("write unit copy");

    let verify = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .expect("run systemd-analyze verify");
    // systemd only warns (exit 0) about unknown keys or unparsable values,
    // so any output at all is a failure.
    assert!(
        verify.status.success() && verify.stderr.is_empty() && verify.stdout.is_empty(),
        "systemd-analyze verify {unit} (exit {:?}):\n{}{}",
        verify.status.code(),
        String::from_utf8_lossy(&verify.stdout),
        stderr(&verify)
    );

    // The sandbox must stay tight: systemd's own exposure score (0 = fully
    // locked down, 10 = unprotected) at most 2.0.
    let security = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--threshold=20", "--no-pager"])
        .arg(&copy)
        .output()
        .expect("run systemd-analyze security");
    let report = String::from_utf8_lossy(&security.stdout);
    if !security.status.success() && !report.contains("Overall exposure level") {
        eprintln!(
            "SKIPPED (LOUDLY): this systemd-analyze cannot score a unit offline: {}",
            stderr(&security).trim()
        );
        return false;
    }
    assert!(
        security.status.success(),
        "{unit}: the exposure score is above 2.0:\n{}",
        report.lines().next_back().unwrap_or_default()
    );
    true
}

#[test]
fn launchd_plist_parses_and_keeps_the_daemon_alive() {
    let dict = plist_dict();
    let string = |key: &str| {
        dict.get(key)
            .and_then(plist::Value::as_string)
            .unwrap_or_else(|| panic!("{PLIST}: no string {key}"))
            .to_owned()
    };
    assert_eq!(string("Label"), "dev.inferd");
    let args = plist_program_arguments(&dict);
    assert_eq!(
        args.get(..2),
        Some(&[INSTALLED_BINARY.to_owned(), "serve".to_owned()][..])
    );
    assert_eq!(
        dict.get("RunAtLoad").and_then(plist::Value::as_boolean),
        Some(true)
    );
    let keep_alive = dict
        .get("KeepAlive")
        .and_then(plist::Value::as_dictionary)
        .unwrap_or_else(|| panic!("{PLIST}: KeepAlive is not a dict"));
    assert_eq!(
        keep_alive
            .get("SuccessfulExit")
            .and_then(plist::Value::as_boolean),
        Some(false),
        "KeepAlive must restart the daemon after a failure only"
    );
    for key in ["StandardErrorPath", "StandardOutPath", "WorkingDirectory"] {
        assert!(string(key).starts_with('/'), "{key} is not absolute");
    }
    assert_ne!(
        string("UserName"),
        "root",
        "the daemon must not run as root"
    );

    let exit_timeout = dict
        .get("ExitTimeOut")
        .and_then(plist::Value::as_unsigned_integer)
        .unwrap_or_else(|| panic!("{PLIST}: no ExitTimeOut"));
    let drain = drain_secs(&read(PLIST_CONFIG));
    assert!(
        exit_timeout > drain,
        "ExitTimeOut {exit_timeout} must exceed drain_timeout = {drain}"
    );
}

#[test]
fn the_command_lines_of_both_service_files_pass_check() {
    if !have_model() {
        return;
    }
    let unit_words = exec_start_words(&parse_unit(&read(UNIT)));
    let plist_words = plist_program_arguments(&plist_dict());
    for (name, words, installed, shipped) in [
        (UNIT, unit_words, INSTALLED_UNIT_CONFIG, UNIT_CONFIG),
        (PLIST, plist_words, INSTALLED_PLIST_CONFIG, PLIST_CONFIG),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = config_copy(dir.path(), shipped, |t| t);
        let args = check_args(&words, installed, &config);
        let out = run_inferd(&args);
        assert!(
            out.status.success(),
            "{name}: `inferd {}` exited {:?}:\n{}",
            args.join(" "),
            out.status.code(),
            stderr(&out)
        );
    }
}

#[test]
fn every_documented_key_is_a_serve_flag() {
    let help = run_inferd(&["serve".to_owned(), "--help".to_owned()]);
    assert!(help.status.success(), "serve --help: {}", stderr(&help));
    let help = String::from_utf8_lossy(&help.stdout);
    for shipped in [UNIT_CONFIG, PLIST_CONFIG] {
        let keys = config_keys(&read(shipped));
        assert!(
            keys.len() >= 10,
            "{shipped}: only {} keys found",
            keys.len()
        );
        for (key, _, _) in keys {
            let flag = format!("--{}", key.replace('_', "-"));
            assert!(
                help.contains(&flag),
                "{shipped} documents `{key}`, but `inferd serve` has no {flag}"
            );
        }
    }
}

/// Runs `serve --check` on the unit's config after `edit`.
fn check_edited_config(edit: impl Fn(String) -> String) -> Output {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = config_copy(dir.path(), UNIT_CONFIG, edit);
    run_inferd(&[
        "serve".to_owned(),
        "--config".to_owned(),
        config.display().to_string(),
        "--check".to_owned(),
    ])
}

#[test]
fn an_unknown_config_key_is_refused_by_name() {
    if !have_model() {
        return;
    }
    let out = check_edited_config(|t| t + "max_sesions = 8\n");
    assert!(!out.status.success(), "a misspelt key was accepted");
    assert!(
        stderr(&out).contains("max_sesions"),
        "the message does not name the key: {}",
        stderr(&out)
    );
}

#[test]
fn a_public_listen_address_needs_a_token_file() {
    if !have_model() {
        return;
    }
    let public =
        |t: String| t.replace("listen = \"127.0.0.1:50051\"", "listen = \"0.0.0.0:50051\"");
    assert!(public(read(UNIT_CONFIG)).contains("listen = \"0.0.0.0:50051\""));

    let out = check_edited_config(public);
    assert!(
        !out.status.success(),
        "a public listen address without a token was accepted"
    );
    let message = stderr(&out).to_lowercase();
    assert!(
        message.contains("token") || message.contains("unauthenticated"),
        "the message does not say a token is needed: {}",
        stderr(&out)
    );

    // The same address is fine once the operator says how callers are
    // authenticated, so the refusal above is about the token alone.
    let out = check_edited_config(|t| public(t) + "allow_unauthenticated = true\n");
    assert!(
        out.status.success(),
        "allow_unauthenticated: {}",
        stderr(&out)
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let token = dir.path().join("auth-token");
    std::fs::write(&token, "interop-test-token\n").expect("write token");
    let out = check_edited_config(|t| public(t) + &format!("auth_token_file = {token:?}\n"));
    assert!(out.status.success(), "auth_token_file: {}", stderr(&out));
}

#[test]
fn unit_time_spans_read_as_seconds() {
    assert_eq!(unit_seconds("45"), 45);
    assert_eq!(unit_seconds("2s"), 2);
    assert_eq!(unit_seconds("1min 30s"), 90);
}

/// `VARIABLE=value` lines of a shipped environment file, commented-out
/// ones included, as (variable, value, commented).
fn env_file(path: &str) -> Vec<(String, String, bool)> {
    read(path)
        .lines()
        .filter_map(|line| {
            let (commented, body) = match line.strip_prefix('#') {
                Some(rest) => (true, rest),
                None => (false, line),
            };
            let (key, value) = body.split_once('=')?;
            let plain = key.starts_with("INFERD_")
                && key.chars().all(|c| c.is_ascii_uppercase() || c == '_');
            plain.then(|| (key.to_owned(), value.to_owned(), commented))
        })
        .collect()
}

/// The variables an environment file sets, with `edits` applied.
fn env_with(path: &str, edits: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut vars: Vec<(String, String)> = env_file(path)
        .into_iter()
        .filter(|(_, _, commented)| !commented)
        .map(|(k, v, _)| (k, v))
        .collect();
    for (key, value) in edits {
        let slot = vars
            .iter_mut()
            .find(|(k, _)| k == key)
            .unwrap_or_else(|| panic!("{path} sets no {key}"));
        slot.1 = (*value).to_owned();
    }
    vars
}

#[test]
fn the_shard_and_relay_units_are_sandboxed_notify_services_reading_their_env_files() {
    for (unit, env, installed_env, subcommand) in [
        (
            SHARD_UNIT,
            SHARD_ENV,
            "/etc/inferd/inferd-shard.env",
            "shard",
        ),
        (
            RELAY_UNIT,
            RELAY_ENV,
            "/etc/inferd/inferd-relay.env",
            "relay",
        ),
    ] {
        let entries = parse_unit(&read(unit));
        for (key, want) in [
            ("Type", "notify"),
            ("Restart", "on-failure"),
            ("DynamicUser", "yes"),
            ("NoNewPrivileges", "yes"),
            ("CapabilityBoundingSet", ""),
            ("ProtectSystem", "strict"),
            ("PrivateDevices", "yes"),
            ("MemoryDenyWriteExecute", "yes"),
            ("EnvironmentFile", installed_env),
        ] {
            assert_eq!(service_value(&entries, key), want, "{unit}: {key}=");
        }
        assert_eq!(
            exec_start_words(&entries),
            [INSTALLED_BINARY, subcommand],
            "{unit}: every setting comes from {installed_env}"
        );
        // Every variable the file documents is one the subcommand reads.
        let help = run_inferd(&[subcommand.to_owned(), "--help".to_owned()]);
        let help = String::from_utf8_lossy(&help.stdout);
        let documented = env_file(env);
        assert!(documented.len() >= 3, "{env}: {documented:?}");
        for (key, _, _) in documented {
            assert!(
                help.contains(&format!("env: {key}=")),
                "{env} documents {key}, which `inferd {subcommand}` does not read"
            );
        }
    }
    for (plist, label, subcommand) in [
        (SHARD_PLIST, "dev.inferd.shard", "shard"),
        (RELAY_PLIST, "dev.inferd.relay", "relay"),
    ] {
        let dict = plist_dict_of(plist);
        assert_eq!(
            dict.get("Label").and_then(plist::Value::as_string),
            Some(label)
        );
        let args = plist_program_arguments(&dict);
        assert_eq!(
            args.get(..2),
            Some(&[INSTALLED_BINARY.to_owned(), subcommand.to_owned()][..]),
            "{plist}"
        );
        assert_ne!(
            dict.get("UserName").and_then(plist::Value::as_string),
            Some("root"),
            "{plist}"
        );
    }
}

#[test]
fn a_split_model_runs_from_the_shipped_service_files() {
    if !have_model() {
        return;
    }
    let model = reference_model().display().to_string();
    // The shard unit's environment, twice (two hosts' halves), the relay's
    // in front of the second, as the files ship apart from addresses and
    // the model's place.
    let states: Vec<tempfile::TempDir> = (0..3)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let state = |i: usize| states[i].path().display().to_string();
    let shard_env = |layers: &str, state: &str| {
        env_with(
            SHARD_ENV,
            &[
                ("INFERD_MODEL", &model),
                ("INFERD_SHARD_LAYERS", layers),
                ("INFERD_SHARD_LISTEN", "127.0.0.1:0"),
                ("INFERD_SHARD_KV_MIB", "32"),
                ("INFERD_SHARD_STATE_DIR", state),
            ],
        )
    };
    let first = support::Inferd::start_full(&[], &["shard"], &shard_env("0..15", &state(0)));
    let second = support::Inferd::start_full(&[], &["shard"], &shard_env("15..30", &state(1)));
    let relay = support::Inferd::start_full(
        &[],
        &["relay"],
        &env_with(
            RELAY_ENV,
            &[
                ("INFERD_RELAY_LISTEN", "127.0.0.1:0"),
                ("INFERD_RELAY_UPSTREAM", &second.addr),
            ],
        ),
    );
    // The plists run the same commands: the shard plist's arguments, with
    // its model and address swapped, make a shard that listens too.
    let mut plist_args = plist_program_arguments(&plist_dict_of(SHARD_PLIST));
    let plist_state = state(2);
    for (flag, value) in [
        ("--model", model.as_str()),
        ("--listen", "127.0.0.1:0"),
        ("--kv-mib", "32"),
        ("--state-dir", plist_state.as_str()),
    ] {
        let at = plist_args
            .iter()
            .position(|a| a == flag)
            .unwrap_or_else(|| panic!("{SHARD_PLIST} passes no {flag}"));
        plist_args[at + 1] = value.to_owned();
    }
    let plist_args: Vec<&str> = plist_args[1..].iter().map(String::as_str).collect();
    let from_plist = support::Inferd::start(&plist_args);
    drop(from_plist);

    // The coordinator from the shipped config, its commented `shards` line
    // filled in.
    let dir = tempfile::tempdir().expect("tempdir");
    let shards = format!(
        "shards = [\"{}=0..15\", \"{}=15..30\"]",
        first.addr, relay.addr
    );
    let config = config_copy(dir.path(), UNIT_CONFIG, |text| {
        assert!(
            text.contains("#shards = ["),
            "{UNIT_CONFIG} documents no shards"
        );
        text.replace("listen = \"127.0.0.1:50051\"", "listen = \"127.0.0.1:0\"")
            .replace("kv_mib = 256", "kv_mib = 32")
            + &shards
            + "\n"
    });
    let config = config.display().to_string();
    let coordinator = support::Inferd::start(&["serve", "--config", &config, "--workers", "1"]);
    let client = support::Client::connect(&coordinator.addr);
    let id = client.create();
    client
        .append(&id, &[1, 504, 3575, 282, 4649, 314])
        .expect("append across the shards");
    let generated = client.generate(&support::greedy(&id, 6, 0));
    assert_eq!(generated.tokens.len(), 6, "{generated:?}");
    assert!(generated.done.is_some(), "{generated:?}");
}
