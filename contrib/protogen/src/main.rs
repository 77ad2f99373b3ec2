//! Regenerates the committed prost code from `proto/`.
//!
//! 1. protox parses the .proto files into a descriptor set (pure Rust, so
//!    neither protoc nor the network is needed).
//! 2. prost-build renders Rust from the descriptors into `src/pb/`.
//! 3. `make proto` runs rustfmt over the result so the committed file is
//!    byte-stable, and CI diffs it against the tree.
//!
//! Usage: `eitri-protogen <proto dir> <out dir>`; `make proto` writes into
//! `src/pb/`, `make proto-check` into a temp dir it diffs against `src/pb/`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [proto_dir, out_dir] = args.as_slice() else {
        eprintln!("usage: eitri-protogen <proto dir> <out dir>");
        return ExitCode::from(2);
    };
    match generate(proto_dir, out_dir) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("protogen: {e}");
            ExitCode::FAILURE
        }
    }
}

fn generate(proto_dir: &Path, out_dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let descriptors = protox::compile(["eitri/agent/v1/agent.proto"], [proto_dir])?;
    std::fs::create_dir_all(out_dir)?;
    prost_build::Config::new()
        .out_dir(out_dir)
        // Standalone mode reads a Snapshot as JSON with the proto's field
        // names and writes each Report as JSON; `default` lets a desired file
        // leave out any field, the epoch included.
        .type_attribute(
            ".eitri.agent.v1",
            "#[derive(serde::Serialize, serde::Deserialize)]\n#[serde(default)]",
        )
        // What a person writes in a desired file is checked key by key: a
        // misspelt key ("vcpu") is refused, naming it, instead of silently
        // leaving its field at zero.
        .type_attribute(".eitri.agent.v1.Snapshot", "#[serde(deny_unknown_fields)]")
        .type_attribute(".eitri.agent.v1.VMSpec", "#[serde(deny_unknown_fields)]")
        .type_attribute(".eitri.agent.v1.VolumeSpec", "#[serde(deny_unknown_fields)]")
        .compile_fds(descriptors)?;
    // The guest agent's exchange: binary only, never JSON, so no serde.
    let descriptors = protox::compile(["eitri/guest/v1/guest.proto"], [proto_dir])?;
    prost_build::Config::new()
        .out_dir(out_dir)
        .compile_fds(descriptors)?;
    Ok(())
}
