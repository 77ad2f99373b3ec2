//! Preflight: the host and the hypervisor binary, checked before any attempt is spent.

use super::*;

/// The host over `h`'s state dir again, its hypervisor and kernel in
/// `elsewhere` (searchable by anyone), so only the state dir's parent can
/// stand in the VMM's way.
pub(crate) fn booting_from(h: &mut Host, elsewhere: &Path) {
    let kernel = elsewhere.join("vmlinux");
    std::fs::write(&kernel, b"not really a kernel").expect("kernel");
    Arc::make_mut(&mut h.cfg.hypervisor).binary = launcher(elsewhere, &[]);
    Arc::make_mut(&mut h.cfg.hypervisor).kernel = Some(kernel);
    drop(h.engine.take());
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    h.engine = Some(h.make_engine());
}

#[test]
fn a_state_dir_under_a_0700_directory_is_refused_naming_it_and_spends_no_attempt() {
    let mut h = Host::new(&[]);
    let elsewhere = tempfile::tempdir().expect("tempdir");
    booting_from(&mut h, elsewhere.path());
    std::fs::set_permissions(h.dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");

    h.tick(&h.vm("vm-1"));
    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    let rec = h.store.get(&id("vm-1")).expect("readable").expect("record");
    let closed = h.dir.path().display().to_string();
    assert!(
        row.last_error.contains(&format!("{closed} is 0700 0:0"))
            && row.last_error.contains(&format!("chmod o+x {closed}"))
            && row.last_error.contains("--state-dir"),
        "{row:?}"
    );
    assert_eq!(row.phase, Some(Phase::Creating));
    assert_eq!(rec.lifecycle.create_attempts(), 0);
    assert!(!h.backend.running(&id("vm-1")));
    std::fs::set_permissions(h.dir.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod back");
}

#[test]
fn a_state_dir_opened_to_0711_converges_at_the_next_tick_with_no_spec_change() {
    let mut h = Host::new(&[]);
    let elsewhere = tempfile::tempdir().expect("tempdir");
    booting_from(&mut h, elsewhere.path());
    std::fs::set_permissions(h.dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    h.tick(&h.vm("vm-1"));

    std::fs::set_permissions(h.dir.path(), std::fs::Permissions::from_mode(0o711)).expect("chmod");
    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert_eq!(row.power, Some(PowerState::Running), "{row:?}");
    assert_eq!(row.phase, Some(Phase::Ready), "{row:?}");
    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn a_hypervisor_installed_after_start_is_found_at_the_next_tick() {
    let mut h = Host::new(&[]);
    let later = h.dir.path().join("installed-later");
    Arc::make_mut(&mut h.cfg.hypervisor).binary = later.clone();
    drop(h.engine.take());
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    h.engine = Some(h.make_engine());
    h.tick(&h.vm("vm-1"));
    let missing = h.row("vm-1");

    std::fs::rename(launcher(h.dir.path(), &[]), &later).expect("install");
    h.tick(&h.vm("vm-1"));

    let row = h.row("vm-1");
    assert!(
        missing.last_error.contains("is not an executable file"),
        "{missing:?}"
    );
    assert_eq!(missing.phase, Some(Phase::Creating));
    assert_eq!(row.phase, Some(Phase::Ready), "{row:?}");
    assert!(h.backend.running(&id("vm-1")));
}

#[test]
fn preflight_names_a_missing_hypervisor() {
    let mut h = Host::new(&[]);
    Arc::make_mut(&mut h.cfg.hypervisor).binary = h.dir.path().join("no-such-hypervisor");
    let backend = CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone());

    let err = backend.preflight(Deadline::NONE).expect_err("missing");

    assert!(err.is_host_condition() && !err.is_permanent());
    assert!(err.to_string().contains("no-such-hypervisor"), "{err}");
}

#[test]
fn a_hypervisor_named_without_a_path_is_found_once_and_run_by_its_absolute_path() {
    // First thing, while this test's process has no other thread: the
    // stand-in's directory on PATH.
    let bin = Path::new(STANDIN).parent().expect("bin dir").to_path_buf();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // SAFETY: no other thread of this process reads the environment now.
    unsafe { std::env::set_var("PATH", path) };
    let h = Host::new(&[]);
    let backend = CloudHypervisor::new(
        Arc::clone(&h.store),
        with_binary(&h.cfg, "eitri-standin-hypervisor".into()),
    );
    let spec = h.spec("vm-1");

    backend.boot(&spec, Deadline::NONE).expect("boot");

    let pid = h.pid("vm-1").expect("pid");
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("exe");
    let _ = backend.destroy(&id("vm-1"), Deadline::NONE);
    assert_eq!(
        std::fs::canonicalize(exe).expect("exe"),
        std::fs::canonicalize(STANDIN).expect("standin")
    );
}

#[test]
fn preflight_refuses_a_hypervisor_below_the_tested_floor_saying_why() {
    let h = Host::new(&[]);
    let old = h.dir.path().join("old-hv");
    std::fs::write(&old, "#!/bin/sh\necho 'cloud-hypervisor v52.0.0'\n").expect("old");
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let backend = CloudHypervisor::new(Arc::clone(&h.store), with_binary(&h.cfg, old));

    let err = backend.preflight(Deadline::NONE).expect_err("too old");

    assert!(err.is_host_condition() && !err.is_permanent());
    assert!(err.to_string().contains("v53 or later"), "{err}");
    assert!(err.to_string().contains("make compat"), "{err}");
}

#[test]
fn a_hypervisor_replaced_by_an_older_one_is_refused_at_the_next_preflight() {
    let h = Host::new(&[]);
    let hv = h.dir.path().join("hv");
    eitri_agent::testkit::standin_hypervisor(Path::new(STANDIN), &hv, &[]);
    let backend = CloudHypervisor::new(Arc::clone(&h.store), with_binary(&h.cfg, hv.clone()));
    backend.preflight(Deadline::NONE).expect("v53 passes");
    // Replaced as a package upgrade does: a new file renamed over it.
    let staged = h.dir.path().join("hv.new");
    std::fs::write(&staged, "#!/bin/sh\necho 'cloud-hypervisor v50.0'\n").expect("old");
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&staged, &hv).expect("replace");

    let err = backend.preflight(Deadline::NONE).expect_err("too old now");

    assert!(err.to_string().contains("v53 or later"), "{err}");
}

pub(crate) fn preflight_passes_on(h: Host) {
    let ok = h.backend.preflight(Deadline::NONE);

    assert!(ok.is_ok(), "{:?}", ok.err().map(|e| e.to_string()));
}
