//! A running template's half: its guest saved where clones are made from,
//! without its VMM stopped. The guest pays a pause, measured; it runs on
//! after.
//!
//! In order:
//! 1. The guest is paused (`vm.pause`): the pause the template pays runs
//!    from here to step 4.
//! 2. Its snapshot written into `snapshot.tmp/`, lent to its VMM, as a
//!    suspend writes one (see [`super`], step 2).
//! 3. Its root disk copied to `template.raw` (by reflink where the
//!    filesystem shares extents, else a sparse copy): paused, the guest
//!    writes nothing more, so the copy is the disk its memory counts on.
//! 4. The guest resumed (`vm.resume`).
//! 5. The snapshot sealed into `.template-new/`, its manifest naming
//!    `template.raw` as its disk, and committed as `template/` (a suspend's
//!    steps 3 and 4), an older one discarded.
//!
//! An error after the pause resumes the guest. A crash leaves it paused:
//! the engine saved that it was taking one first, and resumes a paused
//! guest at its next pass ([`unpause`](CloudHypervisor::unpause_guest)).
//! A crash before the commit leaves no `template/`, and the engine takes
//! one again.
//!
//! A clone copies `template/` and `template.raw` as it copies a suspended
//! template's `snapshot/` and `disk.raw` (see `clone`), and a template
//! saved again while it copies refuses the copy.

use std::io;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use super::save::{SnapshotPaths, Taken, seal_and_commit};
use super::{API_TIMEOUT, discard, failed, put};
use crate::deadline::Deadline;
use crate::error::Outcome;
use crate::human::unix_ms;
use crate::model::Id;
use crate::provision::cloudhv::CloudHypervisor;
use crate::provision::cloudhv::error::CloudHvError;
use crate::stages::timed;

impl CloudHypervisor {
    /// Saves the running VM's guest as its template (the steps of the
    /// module): how long its guest was paused.
    pub(in crate::provision::cloudhv) fn save_as_template(
        &self,
        taken: &Taken,
        vm_id: &Id,
        deadline: Deadline,
    ) -> Outcome<Duration> {
        if self.find(vm_id).is_none() {
            return Err(CloudHvError::NotRunning {
                vm_id: vm_id.clone(),
            }
            .into());
        }
        let layout = self.store.layout();
        let socket = self.socket_path(vm_id);
        let paused_at = Instant::now();
        self.pause_guest(vm_id, deadline)?;
        crate::crash::point("template.paused");
        let written = self.write_snapshot(taken, vm_id, deadline, &|_| {});
        let copied = written.and_then(|work| {
            crate::crash::point("template.snapshot-written");
            timed("copy disk", || {
                crate::disk::copy(
                    &layout.root_disk(vm_id),
                    &layout.template_disk(vm_id),
                    deadline,
                )
            })
            .map_err(|e| failed(vm_id, "copy its root disk", e))?;
            Ok(work)
        });
        let resumed = timed("resume", || {
            put(
                &socket,
                "/api/v1/vm.resume",
                None,
                Deadline::after(API_TIMEOUT),
            )
        });
        let paused = paused_at.elapsed();
        resumed.map_err(|e| failed(vm_id, "resume its guest", e))?;
        let work = copied?;
        let paths = SnapshotPaths {
            incoming: layout.template_incoming(vm_id),
            committed: layout.template(vm_id),
            discarded: layout.template_discarded(vm_id),
        };
        let held = Taken {
            disks: vec![layout.template_disk(vm_id)],
            memory_bytes: taken.memory_bytes,
            expected: taken.expected.clone(),
        };
        let taken_at_ms = unix_ms(SystemTime::now());
        timed("commit", || {
            seal_and_commit(&work, &paths, &layout.vm_dir(vm_id), &held, taken_at_ms)
        })
        .map_err(|e| failed(vm_id, "commit its template", e))?;
        crate::crash::point("template.committed");
        Ok(paused)
    }

    /// Removes the VM's template and its disk, whole or not.
    pub(in crate::provision::cloudhv) fn drop_template(&self, vm_id: &Id) -> Outcome {
        let layout = self.store.layout();
        discard(&layout.template(vm_id), &layout.template_discarded(vm_id))
            .and_then(|()| remove_if_there(&layout.template_disk(vm_id)))
            .map_err(|e| failed(vm_id, "discard its template", e))
    }

    /// Resumes the VM's guest if its VMM says it is paused; a VMM not
    /// running, or a guest that runs, is left as it is.
    pub(in crate::provision::cloudhv) fn unpause_guest(
        &self,
        vm_id: &Id,
        deadline: Deadline,
    ) -> Outcome {
        if self.find(vm_id).is_none() {
            return Ok(());
        }
        let socket = self.socket_path(vm_id);
        let bound = deadline.capped(API_TIMEOUT);
        let timeout = bound.remaining().unwrap_or(API_TIMEOUT);
        let (code, body) =
            crate::provision::cloudhv::api::call(&socket, "GET", "/api/v1/vm.info", timeout)
                .map_err(|e| failed(vm_id, "ask its VMM whether its guest runs", e))?;
        let state = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("state").and_then(|s| s.as_str()).map(str::to_owned));
        if code != 200 || state.as_deref() != Some("Paused") {
            return Ok(());
        }
        log::warn!(
            "VM {vm_id}: its guest was left paused (a template's save cut short): resuming it"
        );
        put(&socket, "/api/v1/vm.resume", None, bound)
            .map_err(|e| failed(vm_id, "resume its guest", e))
    }
}

fn remove_if_there(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}
