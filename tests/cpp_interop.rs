//! A C++ client of the shard protocol, generated from the published schema
//! with Debian's protoc and grpc_cpp_plugin and built against libgrpc++
//! (`scripts/cpp-client`; `tests/interop/cpp/shard_client.cc` says what it
//! checks), as the shard protocol's specification asks of a second
//! language: it decodes every golden frame of `tests/vectors/shard/`, and
//! drives a real `inferd shard` through a frame of every kind and every
//! bad frame, each refused with its kind.

mod support;

use std::path::Path;
use std::process::Command;

use inferd::cluster::fingerprint::sha256_of_file;
use support::{have_reference, Inferd};

const VECTORS: &str = "tests/vectors/shard";

/// The built client, or `None` (after saying so loudly) outside CI on a
/// machine without the C++ gRPC packages.
fn client() -> Option<String> {
    let built = support::script_output("cpp-client");
    if built.is_none() {
        assert!(
            !support::vocabs_required(),
            "scripts/cpp-client failed in CI"
        );
        eprintln!(
            "SKIPPED (LOUDLY): the C++ client did not build; scripts/setup installs its packages"
        );
    }
    built
}

fn run(client: &str, args: &[&str]) -> String {
    let mut command = Command::new(client);
    command.args(args);
    support::run_client("C++ client", &mut command, "checks passed")
}

#[test]
fn a_cpp_client_decodes_every_golden_frame() {
    let Some(client) = client() else {
        return;
    };
    let text = std::fs::read_to_string(Path::new(VECTORS).join("manifest.json")).expect("manifest");
    let manifest: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let number = |key: &str| manifest[key].as_u64().expect(key);
    let mut plan = String::new();
    let mut frames = 0;
    for case in manifest["cases"].as_array().expect("cases") {
        for frame in case["frames"].as_array().expect("frames") {
            plan.push_str(&format!(
                "{} {} {} {} {} {}\n",
                frame["file"].as_str().expect("file"),
                frame["expect"].as_str().expect("expect"),
                number("shard_epoch"),
                number("coordinator_epoch"),
                number("max_frame_bytes"),
                number("hidden_size"),
            ));
            frames += 1;
        }
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let plan_path = dir.path().join("plan.txt");
    std::fs::write(&plan_path, plan).expect("plan");
    let out = run(
        &client,
        &["vectors", VECTORS, plan_path.to_str().expect("utf-8")],
    );
    assert!(out.contains(&format!("{frames} checks passed")), "{out}");
}

#[test]
fn a_cpp_client_drives_a_real_shard_through_every_frame_kind_and_bad_frame() {
    if !have_reference() {
        return;
    }
    let Some(client) = client() else {
        return;
    };
    let model = inferd::model::Model::load(support::REFERENCE).expect("model");
    let hash = sha256_of_file(Path::new(support::REFERENCE)).expect("hash");
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    let state = tempfile::tempdir().expect("temp dir");
    let count = model.config.n_layers.to_string();
    let mut args = support::shard_args(&format!("0..{count}"), "127.0.0.1:0");
    let state_path = state.path().to_str().expect("utf-8").to_owned();
    args.extend(["--state-dir", &state_path]);
    let shard = Inferd::start(&args);
    let hidden = model.config.hidden.to_string();
    run(
        &client,
        &["live", &shard.addr, &hex, "0", &count, &count, &hidden],
    );
}
