//! `eitri-agent images list` shows the cached base images and the VMs that
//! name each, reading, beside a running agent or not; `images prune`
//! removes those no VM record names, and opens the store, so it refuses to
//! run beside a live agent.

use std::path::Path;
use std::process::ExitCode;

use super::fail;
use crate::state::Store;

pub(super) fn prune(state_dir: &Path) -> ExitCode {
    let store = match Store::open(state_dir) {
        Ok(store) => store,
        Err(e) => return fail(&e),
    };
    match crate::image::prune(&store) {
        Ok(pruned) => {
            for sha in &pruned.removed {
                println!("removed {sha}");
            }
            println!(
                "{} image(s) removed, {:.1} MiB freed",
                pruned.removed.len(),
                pruned.bytes as f64 / (1u64 << 20) as f64
            );
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

pub(super) fn list(state_dir: &Path) -> ExitCode {
    use std::collections::BTreeMap;
    use std::os::unix::fs::MetadataExt;
    let layout = crate::state::Layout::new(state_dir);
    let records = match crate::state::read_records(&layout) {
        Ok(records) => records,
        Err(e) => return fail(&e),
    };
    let mut named: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (vm_id, slot) in &records {
        if let crate::state::RecordSlot::Readable(rec) = slot {
            named
                .entry(rec.spec.image_sha256.clone())
                .or_default()
                .push(vm_id.to_string());
        }
    }
    let dir = layout.images();
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!("no image cached (no {})", dir.display());
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("eitri-agent: error: cannot list {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    };
    let now = std::time::SystemTime::now();
    let mut rows: Vec<String> = entries
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().into_string().ok()?;
            // The cache's own files: a digest each; partial downloads and
            // the cache's lock are not images.
            let digest = name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit());
            let meta = entry.metadata().ok().filter(|m| digest && m.is_file())?;
            let age = meta
                .modified()
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .map_or_else(|| "-".to_owned(), crate::human::duration);
            let vms = named
                .get(&name)
                .map_or_else(|| "-".to_owned(), |v| v.join(","));
            Some(format!(
                "{name}  {:>10}  {:>10}  {:>8}  {vms}",
                crate::human::bytes(meta.len()),
                crate::human::bytes(meta.blocks() * 512),
                age
            ))
        })
        .collect();
    rows.sort();
    println!(
        "{:<64}  {:>10}  {:>10}  {:>8}  VMS",
        "SHA256", "SIZE", "ON DISK", "CACHED"
    );
    for row in &rows {
        println!("{row}");
    }
    if rows.is_empty() {
        println!("(no image cached)");
    }
    ExitCode::SUCCESS
}
