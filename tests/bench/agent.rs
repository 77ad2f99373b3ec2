//! What the benchmarks that run VMs through the whole agent share: a
//! host's backend configuration, the engine's seams over it, a base image.

#![allow(
    dead_code,
    reason = "shared by the benchmarks, each of which uses only a part"
)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use eitri_agent::hostkey::LocalHostKeys;
use eitri_agent::image::{ImageCache, ImageOptions};
use eitri_agent::provision::HypervisorSettings;
use eitri_agent::provision::Lifecycle;
use eitri_agent::provision::cloudhv::{CloudHvConfig, CloudHypervisor};
use eitri_agent::provision::supervise::StopTimeouts;
use eitri_agent::reconcile::Seams;
use eitri_agent::seed::NoCloudSeed;
use eitri_agent::state::Store;

/// The seams of an engine over `backend`, base images served from under
/// `images` (`file://`).
pub fn seams(store: &Arc<Store>, backend: Arc<CloudHypervisor>, images: &Path) -> Seams {
    Seams {
        provisioner: backend as Arc<dyn Lifecycle>,
        images: Arc::new(ImageCache::with(
            store.layout().images(),
            &ImageOptions {
                file_root: Some(images.to_path_buf()),
                ..ImageOptions::default()
            },
        )),
        seed: Arc::new(NoCloudSeed::default()),
        host_keys: Arc::new(LocalHostKeys),
        host: eitri_agent::testkit::Fakes::new().seams().host,
    }
}

type Error = Box<dyn std::error::Error>;

/// A cloud-hypervisor backend's configuration as a host runs it, over
/// `dir` and `store`: each VMM jailed, the host network on (call it in a
/// private network namespace) with taps named `prefix…`, and for a real
/// hypervisor the real KVM and userfaultfd devices (its group given access
/// by an ACL entry, as on a host).
pub fn host_config(
    dir: &Path,
    store: &Store,
    (hypervisor, kernel): (PathBuf, PathBuf),
    prefix: &str,
    real: bool,
) -> Result<CloudHvConfig, Error> {
    let network = eitri_agent::net::host::HostNetwork::setup(
        eitri_agent::net::underlay::UnderlayConfig {
            tap_prefix: prefix.to_owned(),
            ..eitri_agent::testkit::net::underlay_config()
        },
        store.layout(),
        vec![],
        std::collections::HashMap::new(),
    )
    .map_err(|e| eitri_agent::error::chain(&*e))?;
    let mut confinement = eitri_agent::testkit::confinement(dir);
    if real {
        confinement.kvm = PathBuf::from("/dev/kvm");
        confinement.userfaultfd = Some(PathBuf::from("/dev/userfaultfd"));
    }
    Ok(CloudHvConfig {
        hypervisor: Arc::new(HypervisorSettings {
            cmdline: "console=ttyS0".into(),
            stop: StopTimeouts {
                power_button: Duration::from_millis(200),
                vmm_shutdown: Duration::from_secs(2),
                terminate: Duration::from_millis(500),
                ..StopTimeouts::default()
            },
            ..HypervisorSettings::new(hypervisor, Some(kernel), dir.join("run"))
        }),
        tap_prefix: prefix.to_owned(),
        boot_wait: Duration::from_secs(30),
        network: Some(Arc::new(network)),
        confinement: Arc::new(confinement),
        limits: Arc::default(),
    })
}

/// A bench's own directory: removed when it is dropped and on ^C or
/// TERM, and reachable (0711) by the jailed VMMs that read their binary
/// and kernel under it.
pub fn bench_dir() -> Result<tempfile::TempDir, Error> {
    let dir = tempfile::tempdir()?;
    eitri_agent::testkit::remove_on_signal(dir.path());
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o711),
    )?;
    Ok(dir)
}

/// A base image under `dir` (1 MiB of one byte), as a `file://` URL and
/// its digest.
pub fn base_image(dir: &Path) -> Result<(String, String), Error> {
    let base = dir.join("base.raw");
    std::fs::write(&base, vec![0x5a; 1 << 20])?;
    let sha = eitri_agent::image::sha256_file(&base)?;
    Ok((format!("file://{}", base.display()), sha))
}

/// The base image a bench's VMs boot: a copy of `image` (a real guest's
/// root filesystem) in `dir`, or a blank one; its `file://` URL and digest.
pub fn image_or_base(image: Option<&Path>, dir: &Path) -> Result<(String, String), Error> {
    match image {
        Some(image) => {
            let to = dir.join("guest.raw");
            std::fs::copy(image, &to)?;
            Ok((
                format!("file://{}", to.display()),
                eitri_agent::image::sha256_file(&to)?,
            ))
        }
        None => base_image(dir),
    }
}
