//! Guest memory on 2 MiB huge pages (`--guest-hugepages`): what a VMM is
//! given, and what a VM the pool cannot hold is told.

use super::*;
use eitri_agent::provision::hugepages::Pool;

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// `h` with its guests on huge pages: a backend and engine made anew.
fn on_hugepages(mut h: Host) -> Host {
    Arc::make_mut(&mut h.cfg.hypervisor).hugepages = true;
    h.backend = Arc::new(CloudHypervisor::new(Arc::clone(&h.store), h.cfg.clone()));
    h.backend.recover(&known(&h.store));
    h.engine = Some(h.make_engine());
    h
}

#[test]
fn a_memory_of_no_whole_number_of_huge_pages_is_refused_naming_the_sizes_to_ask() {
    let h = on_hugepages(Host::new(&[]));
    let mut spec = h.spec("vm-1");
    spec.mem_mb = 257;

    let e = h.backend.boot(&spec, Deadline::NONE).expect_err("refused");

    assert!(e.is_permanent(), "no retry of this spec can boot: {e}");
    let said = eitri_agent::error::chain(&*e);
    assert!(said.contains("256 or 258 MiB"), "{said}");
    assert_eq!(vmms_of(&h, "vm-1"), 0);
}

#[test]
fn a_memory_the_pool_cannot_hold_is_a_host_condition_and_starts_no_hypervisor() {
    let h = on_hugepages(Host::new(&[]));
    let mut spec = h.spec("vm-1");
    // 1 TiB: more than any test host sets aside.
    spec.mem_mb = 1 << 20;

    let e = h.backend.boot(&spec, Deadline::NONE).expect_err("refused");

    assert!(e.is_host_condition(), "passes once the pool grows: {e}");
    let said = eitri_agent::error::chain(&*e);
    assert!(said.contains("needs 524288 huge pages"), "{said}");
    assert!(said.contains("vm.nr_hugepages"), "{said}");
    assert_eq!(vmms_of(&h, "vm-1"), 0);
}

/// `extra` more pages set aside for one test; the pool put back as it was
/// when dropped.
struct Reserved {
    before: u64,
}

impl Reserved {
    fn more(extra: u64) -> Result<Reserved, String> {
        let before = Pool::of_host()
            .map_err(|e| format!("no 2 MiB huge page pool here: {e}"))?
            .total;
        std::fs::write(NR_HUGEPAGES, (before + extra).to_string())
            .map_err(|e| format!("cannot set pages aside: {e}"))?;
        let reserved = Reserved { before };
        match Pool::of_host() {
            Ok(pool) if pool.total >= before + extra => Ok(reserved),
            _ => Err(format!(
                "the kernel set fewer than {extra} more pages aside (memory too fragmented)"
            )),
        }
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.before.to_string());
    }
}

fn available() -> u64 {
    Pool::of_host().expect("pool").available
}

/// A real cloud-hypervisor maps the guest's memory from the pool at boot
/// (so a pool too small fails the boot, never the running guest),
/// restores a snapshot onto huge pages again, and gives the pages back
/// when its VM is destroyed.
#[test]
fn a_real_guest_on_huge_pages_takes_them_from_the_pool_and_gives_them_back() {
    eitri_agent::testkit::net::private_network();
    let h = match real_host() {
        Ok(h) => h,
        Err(why) => return println!("SKIPPED: {why}"),
    };
    let spec = h.spec("vm-1");
    let pages = spec.mem_mb / 2;
    let _reserved = match Reserved::more(pages) {
        Ok(r) => r,
        Err(why) => return println!("SKIPPED: {why}"),
    };
    let mut h = on_hugepages(h);
    h.connect();
    let before = available();

    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let (running, config) = (available(), limits::vm_config(&h, "vm-1"));
    h.tick(&wanting(&h, "vm-1", PowerState::Suspended));
    let asleep = available();
    h.tick(&wanting(&h, "vm-1", PowerState::Running));
    let resumed = (
        h.row("vm-1").power,
        available(),
        limits::vm_config(&h, "vm-1")["memory"]["hugepages"].clone(),
    );
    h.tick(&snapshot(2, vec![tombstoned("vm-1")]));

    assert_eq!(config["memory"]["hugepages"], true, "{config}");
    assert_eq!(running, before - pages, "its memory is the pool's");
    assert_eq!(asleep, before, "a suspended VM holds no page");
    assert_eq!(
        resumed,
        (Some(PowerState::Running), before - pages, true.into())
    );
    assert_eq!(available(), before, "destroyed, it gives them back");
}

#[test]
fn with_guests_on_huge_pages_preflight_refuses_a_hypervisor_that_cannot_reserve_them() {
    let h = Host::new(&[]);
    let old = h.dir.path().join("v52-hv");
    std::fs::write(&old, "#!/bin/sh\necho 'cloud-hypervisor v52.0'\n").expect("old");
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut cfg = with_binary(&h.cfg, old);
    Arc::make_mut(&mut cfg.hypervisor).hugepages = true;
    let backend = CloudHypervisor::new(Arc::clone(&h.store), cfg);

    let err = backend.preflight(Deadline::NONE).expect_err("too old");

    assert!(err.is_host_condition(), "{err}");
    assert!(err.to_string().contains("v53 or later"), "{err}");
    assert!(err.to_string().contains("reserve=on"), "{err}");
}
