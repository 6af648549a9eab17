//! Generates the Rust code of the gRPC schemas under `protos/`: messages with
//! rust-protobuf 2 and service stubs with grpcio-compiler, into `OUT_DIR`.
//!
//! No `protoc` is needed: the files are parsed by the pure-Rust parser of
//! `protobuf-parse` 3. Its descriptors are re-read as rust-protobuf 2
//! descriptors (the wire format of `FileDescriptorProto` is the same) because
//! grpcio's codec and code generator speak rust-protobuf 2, and the pure
//! parser of rust-protobuf 2 drops `service` blocks. The output depends only
//! on the `.proto` files, so builds are reproducible and offline.

use std::error::Error;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One generated Rust module: a group of `.proto` files that share a package.
struct Package {
    /// Name of the Rust module the package's files become (e.g. `kakeya_v1`).
    module: &'static str,
    /// The `.proto` files, relative to `protos/`.
    files: &'static [&'static str],
}

const PACKAGES: &[Package] = &[
    Package {
        module: "kakeya_v1",
        files: &["kakeya/v1/runtime.proto"],
    },
    Package {
        module: "grpc_health_v1",
        files: &["grpc/health/v1/health.proto"],
    },
    Package {
        module: "inferd_shard_v1",
        files: &["inferd/shard/v1/shard_runtime.proto"],
    },
    Package {
        module: "inferd_session_v1",
        files: &["inferd/session/v1/session_service.proto"],
    },
];

fn main() -> Result<(), Box<dyn Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let proto_root = root.join("protos");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=protos");

    let inputs: Vec<PathBuf> = PACKAGES
        .iter()
        .flat_map(|package| package.files.iter().map(|file| proto_root.join(file)))
        .collect();
    for input in &inputs {
        println!("cargo:rerun-if-changed={}", input.display());
    }
    let parsed = protobuf_parse::Parser::new()
        .pure()
        .include(&proto_root)
        .inputs(&inputs)
        .parse_and_typecheck()?;
    let mut descriptors = parsed
        .file_descriptors
        .iter()
        .map(to_protobuf2)
        .collect::<Result<Vec<_>, _>>()?;
    for file in &mut descriptors {
        if file.get_syntax() == "proto3" {
            for message in file.mut_message_type().iter_mut() {
                pack_repeated_scalars(message);
            }
        }
    }

    for package in PACKAGES {
        let names: Vec<String> = package.files.iter().map(|f| f.to_string()).collect();
        let messages = protobuf_codegen::gen(
            &descriptors,
            &names,
            &protobuf_codegen::Customize::default(),
        );
        let services = grpcio_compiler::codegen::gen(&descriptors, &names);
        let module = wrap_modules(
            messages
                .iter()
                .chain(&services)
                .map(|generated| (generated.name.as_str(), generated.content.as_slice())),
        )?;
        write_if_changed(&out_dir.join(format!("{}.rs", package.module)), &module)?;
    }
    Ok(())
}

/// Re-reads a rust-protobuf 3 descriptor as a rust-protobuf 2 one.
fn to_protobuf2(
    descriptor: &protobuf3::descriptor::FileDescriptorProto,
) -> Result<protobuf::descriptor::FileDescriptorProto, Box<dyn Error>> {
    let bytes = protobuf3::Message::write_to_bytes(descriptor)?;
    Ok(protobuf::Message::parse_from_bytes(&bytes)?)
}

/// Marks repeated numeric fields `packed` unless they say otherwise: proto3
/// packs them by default, but rust-protobuf 2 only packs what the descriptor
/// marks, and would otherwise send them unpacked (valid, yet neither canonical
/// nor what other proto3 implementations send).
fn pack_repeated_scalars(message: &mut protobuf::descriptor::DescriptorProto) {
    use protobuf::descriptor::FieldDescriptorProto_Label as Label;
    use protobuf::descriptor::FieldDescriptorProto_Type as Type;
    for field in message.mut_field().iter_mut() {
        let packable = !matches!(
            field.get_field_type(),
            Type::TYPE_STRING | Type::TYPE_BYTES | Type::TYPE_MESSAGE | Type::TYPE_GROUP
        );
        if field.get_label() == Label::LABEL_REPEATED
            && packable
            && !field.get_options().has_packed()
        {
            field.mut_options().set_packed(true);
        }
    }
    for nested in message.mut_nested_type().iter_mut() {
        pack_repeated_scalars(nested);
    }
}

/// Puts each generated file in its own inline module named after the file, so
/// the inner attributes the generators emit stay legal (an `include!` of a
/// file that starts with `#![...]` is not) and the service stubs find their
/// messages at `super::<file>`.
fn wrap_modules<'a>(
    files: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> Result<String, Box<dyn Error>> {
    let mut module = String::new();
    for (name, content) in files {
        let module_name = name
            .strip_suffix(".rs")
            .ok_or_else(|| format!("generated file {name:?} is not a .rs file"))?;
        // grpcio-compiler keeps the method descriptors private; they are made
        // public so servers and tests can name the methods (and their kinds).
        let content =
            std::str::from_utf8(content)?.replace("\nconst METHOD_", "\npub const METHOD_");
        writeln!(module, "pub mod {module_name} {{\n{content}\n}}")?;
    }
    Ok(module)
}

/// Writes `content` unless the file already holds it, so an unchanged schema
/// does not make cargo recompile the crate.
fn write_if_changed(path: &Path, content: &str) -> std::io::Result<()> {
    if std::fs::read_to_string(path).ok().as_deref() == Some(content) {
        return Ok(());
    }
    std::fs::write(path, content)
}
