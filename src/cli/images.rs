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
    let mut images = match crate::image::cached(&dir) {
        Ok(images) => images,
        Err(_) if !dir.exists() => Vec::new(),
        Err(e) => return fail(&e),
    };
    images.sort_by(|a, b| a.name.cmp(&b.name));
    let now = std::time::SystemTime::now();
    println!(
        "{:<64}  {:>10}  {:>10}  {:>8}  VMS",
        "SHA256", "SIZE", "ON DISK", "CACHED"
    );
    for image in &images {
        let age = now
            .duration_since(image.modified)
            .map_or_else(|_| "-".to_owned(), crate::human::duration);
        let vms = named
            .get(&image.name)
            .map_or_else(|| "-".to_owned(), |v| v.join(","));
        println!(
            "{:<64}  {:>10}  {:>10}  {age:>8}  {vms}",
            image.name,
            crate::human::bytes(image.len),
            crate::human::bytes(image.allocated),
        );
    }
    if images.is_empty() {
        println!("(no image cached)");
    }
    ExitCode::SUCCESS
}
