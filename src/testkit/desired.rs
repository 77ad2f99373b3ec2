//! What tests desire: VM entries and snapshots of them, and the stand-in
//! hypervisor carrying its knobs.

use std::sync::Arc;

use crate::model::{DesiredVm, Id, PowerState, Snapshot, VmSpec, WantedVm};

/// What comes, in a copy of the stand-in hypervisor (see
/// [`standin_hypervisor`]), after its binary and before the knobs it
/// carries, and what ends the copy after them.
pub const STANDIN_KNOBS: (&[u8], &[u8]) = (b"\n--eitri-standin-knobs--\n", b"\n--end--\n");

/// A copy of the stand-in hypervisor `standin` at `at`, carrying `knobs`
/// (its `STANDIN_*` settings) after its last byte, where no ELF loader
/// looks. A VMM sees only its own binary (a mount namespace of its own)
/// and starts with an empty environment, so a wrapper script that set the
/// knobs and exec'd the stand-in would find neither: the copy is the
/// whole hypervisor, knobs and all.
pub fn standin_hypervisor(standin: &std::path::Path, at: &std::path::Path, knobs: &[(&str, &str)]) {
    use std::os::unix::fs::PermissionsExt;
    let mut bytes = std::fs::read(standin).unwrap_or_else(|e| panic!("{}: {e}", standin.display()));
    bytes.extend_from_slice(STANDIN_KNOBS.0);
    for (name, value) in knobs {
        bytes.extend_from_slice(format!("{name}={value}\n").as_bytes());
    }
    bytes.extend_from_slice(STANDIN_KNOBS.1);
    std::fs::write(at, bytes).unwrap_or_else(|e| panic!("{}: {e}", at.display()));
    std::fs::set_permissions(at, std::fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", at.display()));
}

/// Parses a test id; panics on a bad one (a test bug).
pub fn id(raw: &str) -> Id {
    Id::parse(raw).unwrap_or_else(|e| panic!("test id: {e}"))
}

/// The image URL the builders give `vm`; the image fake is keyed by it.
pub fn image_url(vm: &str) -> String {
    format!("http://images.test/{vm}.raw")
}

/// A valid desired VM, running, 1 vCPU, 256 MiB, 1 GiB disk.
pub fn desired(vm: &str) -> DesiredVm {
    DesiredVm {
        spec: VmSpec {
            vm_id: id(vm),
            name: vm.replace(['_', '.'], "-"),
            image_url: image_url(vm),
            image_sha256: "ab".repeat(32),
            cloud_init: String::new(),
            ssh_authorized_key: String::new(),
            network: String::new(),
            volume_ids: Vec::new(),
            vcpus: 1,
            mem_mb: 256,
            disk_gb: 1,
            limits: crate::model::VmLimits::default(),
            clone_of: None,
        },
        power: PowerState::Running,
        host_cert_required: false,
        ssh_host_cert: String::new(),
        ssh_user_ca_keys: Vec::new(),
        egress: crate::model::Egress::default(),
        readiness: None,
        published: Vec::new(),
        sleep: crate::model::Sleep::default(),
        on_panic: crate::model::OnPanic::default(),
        template: false,
    }
}

pub fn present(d: DesiredVm) -> WantedVm {
    WantedVm::Present(Arc::new(d))
}

pub fn tombstoned(vm: &str) -> WantedVm {
    WantedVm::Tombstoned(id(vm))
}

/// A snapshot of `vms` at `epoch`.
pub fn snapshot(epoch: u64, vms: Vec<WantedVm>) -> Snapshot {
    Snapshot {
        epoch,
        vms,
        ..Snapshot::default()
    }
}
