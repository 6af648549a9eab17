//! The replicas' deployment files as an operator uses them: every document
//! of `deploy/kubernetes/` passes the Kubernetes API's own types (the
//! official client's generated models, `tests/interop/k8s_validate.py`),
//! and broken copies fail by name; the container's command line passes
//! `inferd serve --check`; HAProxy accepts `deploy/replicas/haproxy.cfg`.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

const MANIFEST: &str = "deploy/kubernetes/inferd.yaml";
const VALIDATOR: &str = "tests/interop/k8s_validate.py";
const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

fn validate(python: &Path, manifest: &Path) -> (bool, String) {
    let out = Command::new(python)
        .arg(VALIDATOR)
        .arg(manifest)
        .output()
        .expect("run the validator");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// A copy of the manifest with `from` replaced by `to` (exactly once).
fn broken_copy(dir: &Path, name: &str, from: &str, to: &str) -> PathBuf {
    let text = std::fs::read_to_string(MANIFEST).expect("the manifest");
    assert_eq!(text.matches(from).count(), 1, "{from:?} is not once in it");
    let path = dir.join(name);
    std::fs::write(&path, text.replace(from, to)).expect("write the copy");
    path
}

#[test]
fn the_kubernetes_manifests_pass_the_api_types_and_broken_ones_fail_by_name() {
    let Some(python) = support::python_env() else {
        return;
    };
    let (ok, report) = validate(&python, Path::new(MANIFEST));
    assert!(ok, "{MANIFEST}:\n{report}");
    assert!(report.contains("3 documents, 0 problems"), "{report}");

    let dir = tempfile::tempdir().expect("temp dir");
    for (name, from, to, named) in [
        (
            "unknown-field.yaml",
            "      grpc:\n              port: 50051\n            periodSeconds: 2",
            "      grpc:\n              port: 50051\n              service: \"\"\n              portName: grpc\n            periodSeconds: 2",
            "portName: V1GRPCAction has no such field",
        ),
        (
            "wrong-type.yaml",
            "timeoutSeconds: 10800",
            "timeoutSeconds: three-hours",
            "timeoutSeconds: int expected",
        ),
        (
            "missing-name.yaml",
            "        - name: inferd\n          image: IMAGE",
            "        - image: IMAGE",
            "containers.0.name",
        ),
    ] {
        let (ok, report) = validate(&python, &broken_copy(dir.path(), name, from, to));
        assert!(!ok, "{name} passed:\n{report}");
        assert!(report.contains(named), "{name}: {named:?} not in\n{report}");
    }
}

#[test]
fn the_kubernetes_command_line_passes_check() {
    let Some(python) = support::python_env() else {
        return;
    };
    if !Path::new(REFERENCE).exists() {
        assert!(
            !support::golden::models_required(),
            "{REFERENCE} is missing"
        );
        eprintln!("SKIPPED: {REFERENCE} is missing (scripts/fetch-model)");
        return;
    }
    let out = Command::new(&python)
        .args([VALIDATOR, "--args", MANIFEST])
        .output()
        .expect("run the validator");
    assert!(out.status.success(), "{out:?}");
    let args: Vec<String> = serde_json::from_slice(&out.stdout).expect("the args as JSON");
    // The pod's paths, pointed at this machine's files.
    let dir = tempfile::tempdir().expect("temp dir");
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "a-token-of-at-least-32-characters-000\n").expect("tokens");
    std::fs::set_permissions(&tokens, std::os::unix::fs::PermissionsExt::from_mode(0o440))
        .expect("mode");
    let mut args: Vec<String> = args
        .into_iter()
        .map(|a| {
            a.replace("/models/model.gguf", REFERENCE)
                .replace("/etc/inferd/tokens/tokens", &tokens.display().to_string())
        })
        .collect();
    args.push("--check".to_owned());
    let run = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(&args)
        .env(
            "INFERD_SESSION_STORE",
            "postgres://inferd:secret@db.invalid:5432/inferd?sslmode=require",
        )
        .env("INFERD_REPLICA_ID", "inferd-0")
        .output()
        .expect("run inferd");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "inferd {}: {}\n{}",
        args.join(" "),
        stdout,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("kept in the session store as replica inferd-0"),
        "{stdout}"
    );
    assert!(!stdout.contains("secret"), "the URL was printed: {stdout}");
}

#[test]
fn haproxy_accepts_the_shipped_configuration() {
    if !support::haproxy::installed() {
        return;
    }
    let replicas: Vec<(String, String)> = (0..3)
        .map(|n| {
            (
                format!("127.0.0.1:{}", 50061 + n),
                format!("127.0.0.1:{}", 8081 + n),
            )
        })
        .collect();
    let out = Command::new(support::haproxy::binary())
        .args(["-c", "-f", support::haproxy::CONFIG])
        .envs(support::haproxy::environment(&replicas))
        .output()
        .expect("run haproxy -c");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Without its addresses it does not start.
    let out = Command::new(support::haproxy::binary())
        .args(["-c", "-f", support::haproxy::CONFIG])
        .env_remove("INFERD_PROXY_GRPC")
        .output()
        .expect("run haproxy -c");
    assert!(!out.status.success());
}
