//! The fakes as each seam the engine is given: the backend and its
//! capabilities, the image cache, the seed builder, the host-key store
//! and the host's facts, each call recorded and acted as told.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use super::{Call, Fakes, Op};
use crate::deadline::Deadline;
use crate::error::{BoxFailure, Outcome, Simple};
use crate::model::{Id, Saved, VmSpec};
use crate::provision::{ExitListener, Holds, Lifecycle, SavedGuest, Say, Spend, Suspend};
use crate::reconcile::seams::{
    HostFacts, HostKey, HostKeys, ImageRequest, Images, SeedBuilder, SeedParams,
};

impl Lifecycle for Fakes {
    fn preflight(&self, deadline: Deadline) -> Outcome {
        self.record(Call::Preflight);
        self.act(Op::Preflight, "", deadline)
    }

    fn prepare_root_disk(
        &self,
        spec: &VmSpec,
        _base: &Path,
        deadline: Deadline,
    ) -> Outcome<crate::state::atomic::Pending> {
        self.record(Call::PrepareRootDisk(spec.vm_id.clone()));
        self.act(Op::PrepareRootDisk, spec.vm_id.as_str(), deadline)?;
        Ok(match self.made.lock().get(&spec.vm_id) {
            Some(path) => crate::state::atomic::Pending::file(path),
            None => crate::state::atomic::Pending::none(),
        })
    }

    fn boot(&self, spec: &VmSpec, deadline: Deadline) -> Outcome {
        self.record(Call::Boot(spec.vm_id.clone()));
        self.act(Op::Boot, spec.vm_id.as_str(), deadline)?;
        self.running.lock().insert(spec.vm_id.clone());
        Ok(())
    }

    fn shutdown(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome {
        self.record(Call::Shutdown(vm_id.clone()));
        say("stopping: pressing the power button");
        self.act(Op::Shutdown, vm_id.as_str(), deadline)?;
        self.running.lock().remove(vm_id);
        Ok(())
    }

    fn destroy(&self, vm_id: &Id, deadline: Deadline) -> Outcome {
        self.record(Call::Destroy(vm_id.clone()));
        self.act(Op::Destroy, vm_id.as_str(), deadline)?;
        self.running.lock().remove(vm_id);
        Ok(())
    }

    fn running(&self, vm_id: &Id) -> bool {
        self.record(Call::Running(vm_id.clone()));
        self.running.lock().contains(vm_id)
    }

    fn failure_reason(&self, vm_id: &Id) -> Option<String> {
        self.record(Call::FailureReason(vm_id.clone()));
        self.reasons.lock().get(vm_id).cloned()
    }

    fn address(&self, vm_id: &Id) -> Option<Ipv4Addr> {
        self.record(Call::Address(vm_id.clone()));
        self.addresses.lock().get(vm_id).and_then(|a| a.underlay)
    }

    fn network_address(&self, vm_id: &Id) -> Option<Ipv4Addr> {
        self.record(Call::NetworkAddress(vm_id.clone()));
        self.addresses.lock().get(vm_id).and_then(|a| a.network)
    }

    fn watch_exits(&self, listener: ExitListener) {
        *self.exits.lock() = Some(listener);
    }

    fn suspender(&self) -> Option<&dyn Suspend> {
        (!self.is_bare()).then_some(self as &dyn Suspend)
    }

    fn holds(&self) -> Option<&dyn Holds> {
        (!self.is_bare()).then_some(self as &dyn Holds)
    }
}

impl Fakes {
    /// The fake clock, in ms since the epoch.
    fn now_ms(&self) -> u64 {
        self.now
            .lock()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }
}

impl Suspend for Fakes {
    /// Saves 64 MiB "taken" now and stops the VM's hypervisor, as the
    /// cloud-hypervisor backend does.
    fn suspend(&self, vm_id: &Id, deadline: Deadline, say: Say<'_>) -> Outcome<Saved> {
        self.record(Call::Suspend(vm_id.clone()));
        say("suspending: saving the guest's state");
        self.act(Op::Suspend, vm_id.as_str(), deadline)?;
        let saved = Saved {
            taken_at_ms: self.now_ms(),
            bytes: 64 << 20,
            in_memory: false,
        };
        self.saved
            .lock()
            .insert(vm_id.clone(), SavedGuest::Usable(saved));
        self.running.lock().remove(vm_id);
        Ok(saved)
    }

    /// Runs a live hypervisor on, or one restored from a usable saved
    /// state, which it then takes; either only once `spend` agrees (a
    /// refusal is recorded as [`Call::ResumeRefused`], the saved state
    /// kept).
    fn resume(&self, spec: &VmSpec, deadline: Deadline, spend: Spend<'_>) -> Outcome {
        let vm_id = &spec.vm_id;
        self.record(Call::Resume(vm_id.clone()));
        self.act(Op::Resume, vm_id.as_str(), deadline)?;
        let live = self.running.lock().contains(vm_id);
        match (live, self.saved.lock().get(vm_id)) {
            (true, _) | (false, Some(SavedGuest::Usable(_))) => {}
            (false, Some(SavedGuest::Unusable(why))) => {
                return Err(Simple::transient(why.clone()).into());
            }
            (false, None) => return Err(Simple::transient("no saved state to resume").into()),
        }
        if let Err(e) = spend() {
            self.record(Call::ResumeRefused(vm_id.clone()));
            return Err(e);
        }
        self.act(Op::Run, vm_id.as_str(), deadline)?;
        self.saved.lock().remove(vm_id);
        self.running.lock().insert(vm_id.clone());
        Ok(())
    }

    /// What a test scripted for `Op::Resumable` (nothing: it can).
    fn resumable(&self, spec: &VmSpec) -> Outcome {
        self.act(Op::Resumable, spec.vm_id.as_str(), Deadline::NONE)
    }

    fn suspension(&self, vm_id: &Id) -> Option<SavedGuest> {
        self.record(Call::Suspension(vm_id.clone()));
        self.saved.lock().get(vm_id).cloned()
    }

    fn discard_suspension(&self, vm_id: &Id, _deadline: Deadline) -> Outcome {
        self.record(Call::DiscardSuspension(vm_id.clone()));
        self.saved.lock().remove(vm_id);
        Ok(())
    }

    /// The template's usable saved state given to the clone too, as the
    /// cloud-hypervisor backend copies it; the template's kept.
    fn clone_saved(
        &self,
        template: &Id,
        spec: &VmSpec,
        deadline: Deadline,
    ) -> Outcome<crate::disk::Method> {
        self.record(Call::CloneSaved(spec.vm_id.clone(), template.clone()));
        self.act(Op::Clone, spec.vm_id.as_str(), deadline)?;
        let mut saved = self.saved.lock();
        let theirs = saved
            .get(template)
            .or(self.templates.lock().get(template))
            .cloned();
        match theirs {
            Some(SavedGuest::Usable(s)) => {
                saved.insert(spec.vm_id.clone(), SavedGuest::Usable(s));
                Ok(crate::disk::Method::Reflink)
            }
            _ => Err(
                Simple::transient(format!("template {template} has no usable saved state")).into(),
            ),
        }
    }

    /// Saves 64 MiB "taken" now as the running VM's template; its guest
    /// "paused" 1 ms.
    fn save_template(&self, vm_id: &Id, deadline: Deadline) -> Outcome<std::time::Duration> {
        self.record(Call::SaveTemplate(vm_id.clone()));
        self.act(Op::SaveTemplate, vm_id.as_str(), deadline)?;
        if !self.running.lock().contains(vm_id) {
            return Err(Simple::transient("its hypervisor is not running").into());
        }
        let saved = Saved {
            taken_at_ms: self.now_ms(),
            bytes: 64 << 20,
            in_memory: false,
        };
        self.templates
            .lock()
            .insert(vm_id.clone(), SavedGuest::Usable(saved));
        Ok(std::time::Duration::from_millis(1))
    }

    fn template_saved(&self, vm_id: &Id) -> Option<SavedGuest> {
        self.templates.lock().get(vm_id).cloned()
    }

    fn discard_template(&self, vm_id: &Id) -> Outcome {
        if self.templates.lock().remove(vm_id).is_some() {
            self.record(Call::DiscardTemplate(vm_id.clone()));
        }
        Ok(())
    }

    fn unpause(&self, vm_id: &Id, _deadline: Deadline) -> Outcome {
        self.record(Call::Unpause(vm_id.clone()));
        Ok(())
    }
}

impl Holds for Fakes {
    fn set_egress(&self, vm_id: &Id, egress: &crate::model::Egress) -> Outcome {
        if self.egress_refused.load(Ordering::SeqCst) && !egress.is_open() {
            return Err(crate::error::Simple::host("the fake host holds no egress rules").into());
        }
        self.egress.lock().insert(vm_id.clone(), egress.clone());
        Ok(())
    }

    fn egress_in_force(&self, vm_id: &Id) -> Option<crate::model::Egress> {
        self.egress
            .lock()
            .get(vm_id)
            .filter(|e| !e.is_open())
            .cloned()
    }

    /// The spec's own: the fake host has no defaults.
    fn limits_in_force(&self, spec: &VmSpec) -> Option<crate::model::VmLimits> {
        Some(spec.limits)
    }

    /// Every port is granted, unless `ports_refused` names it: refused as
    /// another VM's (a permanent error).
    fn set_published(&self, vm_id: &Id, wanted: &[crate::model::Publish]) -> Outcome {
        let refused = self.ports_refused.lock().clone();
        let (granted, denied): (Vec<_>, Vec<_>) =
            wanted.iter().partition(|p| !refused.contains(&p.host_port));
        self.published.lock().insert(vm_id.clone(), granted);
        match denied.first() {
            None => Ok(()),
            Some(p) => Err(crate::error::Simple::permanent(format!(
                "{}: the fake host gave it to another VM",
                p.host_side()
            ))
            .into()),
        }
    }

    fn published(&self, vm_id: &Id) -> Vec<crate::model::Publish> {
        self.published
            .lock()
            .get(vm_id)
            .cloned()
            .unwrap_or_default()
    }
}

impl Images for Fakes {
    fn resolve(&self, wanted: ImageRequest<'_>) -> Outcome<crate::reconcile::seams::Base> {
        let (url, sha256, deadline) = (wanted.url, wanted.sha256, wanted.deadline);
        let progress = wanted.progress;
        self.record(Call::Resolve {
            url: url.to_owned(),
        });
        self.callbacks
            .lock()
            .insert(url.to_owned(), Arc::clone(&progress));
        let steps = self.progress.lock().get(url).cloned().unwrap_or_default();
        for (done, total) in steps {
            progress(done, total);
        }
        self.act(Op::Resolve, url, deadline)?;
        Ok(crate::reconcile::seams::Base::unheld(PathBuf::from(
            format!("/fake/images/{sha256}"),
        )))
    }
}

impl SeedBuilder for Fakes {
    fn build(&self, _out: &Path, params: &SeedParams) -> Outcome<crate::state::atomic::Pending> {
        self.record(Call::Seed(Box::new(params.clone())));
        self.act(Op::Seed, &params.instance_id, Deadline::NONE)
            .map(|()| crate::state::atomic::Pending::none())
    }
}

impl HostKeys for Fakes {
    /// Persists a made-up key at `path` (creating its directory), so the
    /// same key comes back after an engine restart, as with the real one.
    fn load_or_create(&self, path: &Path) -> Outcome<HostKey> {
        self.record(Call::HostKey(path.to_path_buf()));
        let vm = path
            .parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        self.act(Op::HostKey, &vm, Deadline::NONE)?;
        let io = |e: std::io::Error| -> BoxFailure { Simple::transient(e.to_string()).into() };
        if let Ok(text) = std::fs::read_to_string(path)
            && let Some((public, private)) = text.split_once('\n')
        {
            return Ok(HostKey {
                public_line: public.to_owned(),
                private_pem: private.to_owned(),
            });
        }
        let n = self.keys_made.fetch_add(1, Ordering::Relaxed);
        let key = HostKey {
            public_line: format!("ssh-ed25519 AAAAFAKE{n}{vm} fake"),
            private_pem: format!("FAKE PRIVATE KEY {n}"),
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        std::fs::write(path, format!("{}\n{}", key.public_line, key.private_pem)).map_err(io)?;
        Ok(key)
    }
}

impl HostFacts for Fakes {
    fn boot_id(&self) -> String {
        self.boot_id.lock().clone()
    }

    fn now(&self) -> SystemTime {
        *self.now.lock()
    }
}
