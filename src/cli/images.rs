//! `eitri-agent images list` shows the cached base images and the VMs that
//! name each; `images prune` removes those no VM record names and the
//! last desired state does not. Both read without the state dir's lock,
//! beside a running agent or not: a prune coordinates with the agent's
//! creates through the image cache's own lock (see `image::prune`).

use std::path::Path;
use std::process::ExitCode;

use super::fail;
use crate::state::Layout;

pub(super) fn prune(state_dir: &Path) -> ExitCode {
    let layout = Layout::new(state_dir);
    let wanted = match crate::daemon::images_named(&layout.last_snapshot()) {
        Ok(wanted) => wanted,
        Err(e) => {
            // Only spares the agent a download: what it uses, its records
            // name, and those are read under the cache's lock.
            eprintln!(
                "eitri-agent: warning: the last desired state ({}) is unreadable: {e}; pruning by the VM records alone",
                layout.last_snapshot().display()
            );
            Default::default()
        }
    };
    match crate::image::prune(&layout, &wanted) {
        Ok(pruned) => {
            for sha in &pruned.removed {
                println!("removed {sha}");
            }
            // What stays, and why: a VM that still has a record (one
            // tombstoned keeps it until it is destroyed), or the last
            // desired state (the agent would fetch it again).
            let named = named_by_records(&layout).unwrap_or_default();
            let kept = crate::image::cached(&layout.images()).unwrap_or_default();
            let mut kept: Vec<String> = kept.into_iter().map(|i| i.name).collect();
            kept.sort();
            for sha in &kept {
                match named.get(sha) {
                    Some(vms) => println!(
                        "kept {sha}: VM {} still has a record (a tombstoned VM keeps it until it is destroyed)",
                        vms.join(", ")
                    ),
                    None if wanted.contains(sha) => println!(
                        "kept {sha}: the last desired state names it (a tombstoned entry's too, until it is gone from there)"
                    ),
                    None => println!("kept {sha}"),
                }
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

/// The VMs whose records name each image, by its digest.
fn named_by_records(
    layout: &Layout,
) -> Result<std::collections::BTreeMap<String, Vec<String>>, crate::state::StoreError> {
    let mut named: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (vm_id, slot) in &crate::state::read_records(layout)? {
        if let crate::state::RecordSlot::Readable(rec) = slot {
            named
                .entry(rec.spec.image_sha256.clone())
                .or_default()
                .push(vm_id.to_string());
        }
    }
    Ok(named)
}

pub(super) fn list(state_dir: &Path) -> ExitCode {
    let layout = Layout::new(state_dir);
    let named = match named_by_records(&layout) {
        Ok(named) => named,
        Err(e) => return fail(&e),
    };
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
